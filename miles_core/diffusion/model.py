"""The image model: a small text-conditioned flow-matching network over pixels.

Images are float [3, S, S] in [-1, 1], generated in pixel space (no VAE). The denoising network
is one of diffusers' two families, chosen by the preset:

- `SD3Transformer2DModel` (MMDiT, the `transformer` component): the image's patches and the
  prompt's per-word states attend to each other jointly in every block, and a pooled prompt
  vector joins the timestep in the blocks' adaptive norms.
- `UNet2DConditionModel` (the `unet` component): convolutional blocks at two or more scales,
  cross-attention to the per-word states below the top scale, and the pooled prompt vector
  projected into the timestep embedding (`class_embed_type="projection"`). Convolutions draw
  clean object edges on pixels where a small transformer over patches leaves ragged ones; being
  translation-equivariant, it learns where to put objects more slowly than what to draw.

Prompts are fixed-length rows of word ids; `WordEncoder` turns them into those states with
learned word and position embeddings, and holds the learned null prompt that the unconditional
branch of classifier-free guidance uses. diffusers' `FlowMatchEulerDiscreteScheduler` gives the
sigma schedule.

The rectified-flow convention: `x_σ = (1 − σ)·x0 + σ·ε` and the model predicts the velocity
`v = ε − x0` (`ImageModel.velocity`). A saved model is a diffusers-style directory
(`save_image_model`, `load_image_model`):

    model_index.json    the components and the image size
    transformer/ or unet/   the denoiser, diffusers `save_pretrained`
    scheduler/          diffusers `save_pretrained`
    text_encoder/       config.json + model.safetensors of the WordEncoder
    vocabulary.json     the words, in id order
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, UNet2DConditionModel
from safetensors.torch import load_file, save_file
from torch import nn

from miles_core.diffusion.scenes import VOCABULARY

PROMPT_LENGTH = 6  # every scene prompt has six words (scenes.py)
MODEL_CLASS = "MilesFlowImageModel"  # model_index.json's `_class_name`: marks our directories
COMPONENTS = ("scheduler", "text_encoder")  # besides the denoiser's (DENOISERS)
# the denoiser's component name in a diffusers directory, for each network class
DENOISERS: dict[str, type[nn.Module]] = {
    "transformer": SD3Transformer2DModel,
    "unet": UNet2DConditionModel,
}
NORM_GROUPS = 8  # the UNet's group norms: its channel counts are multiples of this


@dataclass(frozen=True)
class MMDiTPreset:
    """The sizes of one MMDiT image model."""

    image_size: int  # S: images are [3, S, S]
    patch_size: int  # the transformer sees (S / patch_size)² patches
    layers: int  # MMDiT blocks
    heads: int
    head_dim: int  # the transformer's width is heads × head_dim
    text_dim: int  # the WordEncoder's width (per-word states and the pooled vector)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}"
            )

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def build(self) -> nn.Module:
        return SD3Transformer2DModel(
            sample_size=self.image_size,
            patch_size=self.patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=self.layers,
            attention_head_dim=self.head_dim,
            num_attention_heads=self.heads,
            joint_attention_dim=self.text_dim,
            caption_projection_dim=self.width,
            pooled_projection_dim=self.text_dim,
            pos_embed_max_size=self.image_size // self.patch_size,
            qk_norm="rms_norm",
        )


@dataclass(frozen=True)
class UNetPreset:
    """The sizes of one UNet image model."""

    image_size: int  # S: images are [3, S, S]; halved at each scale but the last
    channels: tuple[int, ...]  # per scale, top first; multiples of NORM_GROUPS
    layers_per_block: int  # residual blocks per scale
    head_dim: int  # cross-attention's head width
    text_dim: int  # the WordEncoder's width (per-word states and the pooled vector)

    def build(self) -> nn.Module:
        scales = len(self.channels)
        return UNet2DConditionModel(
            sample_size=self.image_size,
            in_channels=3,
            out_channels=3,
            block_out_channels=self.channels,
            layers_per_block=self.layers_per_block,
            norm_num_groups=NORM_GROUPS,
            cross_attention_dim=self.text_dim,
            attention_head_dim=self.head_dim,
            down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (scales - 1),
            up_block_types=("CrossAttnUpBlock2D",) * (scales - 1) + ("UpBlock2D",),
            class_embed_type="projection",
            projection_class_embeddings_input_dim=self.text_dim,
        )


PRESETS: dict[str, MMDiTPreset | UNetPreset] = {
    # for tests: a training step in milliseconds (≈0.08M parameters)
    "tiny": MMDiTPreset(image_size=24, patch_size=4, layers=2, heads=2, head_dim=16, text_dim=32),
    # ≈1.3M parameters
    "small": MMDiTPreset(image_size=24, patch_size=2, layers=4, heads=4, head_dim=24, text_dim=64),
    # for tests of the UNet family
    "unet-tiny": UNetPreset(
        image_size=24, channels=(8, 16), layers_per_block=1, head_dim=8, text_dim=32
    ),
    # for the 2-core RL example (≈1.0M parameters)
    "unet-small": UNetPreset(
        image_size=24, channels=(32, 64), layers_per_block=1, head_dim=8, text_dim=64
    ),
}


class WordEncoder(nn.Module):
    """Per-word states and a pooled vector for prompts given as word ids.

    A word's state is the layer norm of its word embedding plus its position's embedding; the
    pooled vector is the mean of a prompt's states. The null prompt (classifier-free guidance's
    unconditional branch) is a learned row of states of its own.
    """

    def __init__(self, vocab_size: int, dim: int, length: int = PROMPT_LENGTH) -> None:
        super().__init__()
        self.config = {"vocab_size": vocab_size, "dim": dim, "length": length}
        self.words = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.null_states = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)

    def forward(
        self, ids: torch.Tensor, null: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(states [B, L, dim], pooled [B, dim]) for `ids` long [B, L]; rows where the bool
        [B] mask `null` is set get the null prompt instead."""
        vocab_size, length = self.config["vocab_size"], self.config["length"]
        if ids.ndim != 2 or ids.shape[1] != length:
            raise ValueError(f"prompt ids must be [batch, {length}]; got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(
                f"prompt ids must lie in [0, {vocab_size}); encode text with ImageModel.encode"
            )
        states = self.norm(self.words(ids) + self.positions)
        if null is not None:
            states = torch.where(null[:, None, None], self.norm(self.null_states), states)
        return states, states.mean(1)


class ImageModel(nn.Module):
    """The denoiser (an MMDiT or a UNet), the word encoder, the sigma schedule and the
    vocabulary, as one model."""

    def __init__(
        self,
        denoiser: nn.Module,
        text_encoder: WordEncoder,
        scheduler: FlowMatchEulerDiscreteScheduler,
        vocabulary: tuple[str, ...],
        image_size: int,
    ) -> None:
        super().__init__()
        if not isinstance(denoiser, tuple(DENOISERS.values())):
            raise TypeError(f"the denoiser is one of {list(DENOISERS.values())}; got {denoiser}")
        self.denoiser = denoiser
        self.text_encoder = text_encoder
        self.scheduler = scheduler
        self.vocabulary = tuple(vocabulary)
        self.image_size = image_size
        self._ids = {word: i for i, word in enumerate(self.vocabulary)}

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """Long [B, PROMPT_LENGTH]: each prompt's words as ids in this model's vocabulary."""
        rows = []
        for text in prompts:
            words = text.split()
            unknown = [word for word in words if word not in self._ids]
            if unknown:
                raise ValueError(
                    f"unknown word {unknown[0]!r} in prompt {text!r}: this model knows only "
                    f"{self.vocabulary} (lower case)"
                )
            if len(words) != PROMPT_LENGTH:
                raise ValueError(
                    f"prompt {text!r} has {len(words)} words; the model takes {PROMPT_LENGTH}"
                )
            rows.append([self._ids[word] for word in words])
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), PROMPT_LENGTH)

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        prompt_ids: torch.Tensor,
        null: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One branch's velocity [B, 3, S, S] at noise level `sigma` (a float or [B]); rows
        where the bool [B] mask `null` is set are conditioned on the null prompt."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
        states, pooled = self.text_encoder(prompt_ids, null)
        timestep = sigma * self.scheduler.config.num_train_timesteps
        if isinstance(self.denoiser, UNet2DConditionModel):
            return self.denoiser(
                x, timestep, encoder_hidden_states=states, class_labels=pooled, return_dict=False
            )[0]
        return self.denoiser(
            hidden_states=x,
            encoder_hidden_states=states,
            pooled_projections=pooled,
            timestep=timestep,
            return_dict=False,
        )[0]

    @property
    def component(self) -> str:
        """The denoiser's component name in a diffusers directory (`transformer` or `unet`)."""
        return next(name for name, cls in DENOISERS.items() if isinstance(self.denoiser, cls))

    def blocks(self) -> list[nn.Module]:
        """The denoiser's blocks, the units a sharded trainer wraps one by one."""
        if isinstance(self.denoiser, UNet2DConditionModel):
            d = self.denoiser
            return [*d.down_blocks, d.mid_block, *d.up_blocks]
        return list(self.denoiser.transformer_blocks)

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        prompt_ids: torch.Tensor,
        guidance: float | None = None,
        detach_unconditional: bool = False,
    ) -> torch.Tensor:
        """The predicted velocity `ε − x0` at `x` [B, 3, S, S] and noise level `sigma`.

        With `guidance` w this is classifier-free guidance, `v_u + w·(v_c − v_u)`, whose
        unconditional branch `v_u` is the null prompt's velocity; `detach_unconditional` computes
        that branch without gradient (Flow-GRPO's training forward). The two branches are
        separate forwards of the same batch size, so a recomputation matches a sample's.
        """
        conditional = self(x, sigma, prompt_ids)
        if guidance is None:
            return conditional
        null = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_unconditional):
            unconditional = self(x, sigma, prompt_ids, null)
        return unconditional + guidance * (conditional - unconditional)


def build_image_model(preset: str, seed: int) -> ImageModel:
    """A randomly initialised model of the preset; the same seed gives the same weights."""
    if preset not in PRESETS:
        raise ValueError(f"unknown image model preset {preset!r}: use one of {tuple(PRESETS)}")
    p = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        denoiser = p.build()
        text_encoder = WordEncoder(len(VOCABULARY), p.text_dim)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    model = ImageModel(denoiser, text_encoder, scheduler, VOCABULARY, p.image_size)
    return model.eval()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_image_model(model: ImageModel, directory: str | Path) -> Path:
    """Writes the model as a diffusers-style directory (the module docstring's layout)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.denoiser.save_pretrained(directory / model.component, safe_serialization=True)
    model.scheduler.save_pretrained(directory / "scheduler")
    text_dir = directory / "text_encoder"
    text_dir.mkdir(exist_ok=True)
    config = {"_class_name": "WordEncoder", **model.text_encoder.config}
    (text_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.text_encoder.state_dict().items()}
    save_file(state, text_dir / "model.safetensors")
    (directory / "vocabulary.json").write_text(json.dumps(list(model.vocabulary)) + "\n")
    index = {
        "_class_name": MODEL_CLASS,
        "_diffusers_version": diffusers.__version__,
        model.component: ["diffusers", type(model.denoiser).__name__],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["miles_core.diffusion.model", "WordEncoder"],
        "image_size": model.image_size,
    }
    (directory / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def check_image_model_dir(directory: Path) -> dict:
    """The directory's model_index.json, once it is known to describe one of our models."""
    hint = "save one with save_image_model or miles_core.diffusion.pretrain.pretrain"
    index_file = directory / "model_index.json"
    if not index_file.is_file():
        raise ValueError(
            f"{directory} is not an image model directory (no model_index.json): {hint}"
        )
    index = json.loads(index_file.read_text())
    if index.get("_class_name") != MODEL_CLASS:
        raise ValueError(
            f"{directory} is not an image model directory: model_index.json names "
            f"{index.get('_class_name')!r}, not {MODEL_CLASS!r}; {hint}"
        )
    denoisers = [name for name in DENOISERS if name in index]
    if len(denoisers) != 1:
        raise ValueError(
            f"{directory}: model_index.json must name one denoiser component, one of "
            f"{list(DENOISERS)}; it names {denoisers}: {hint}"
        )
    missing = [
        name
        for name in (*denoisers, *COMPONENTS, "vocabulary.json", "text_encoder/model.safetensors")
        if not (directory / name).exists()
    ]
    if missing:
        raise ValueError(f"image model directory {directory} lacks {missing}: {hint}")
    return index


def load_image_model(directory: str | Path) -> ImageModel:
    """The model saved in `directory` by `save_image_model`, in eval mode."""
    directory = Path(directory)
    index = check_image_model_dir(directory)
    component = next(name for name in DENOISERS if name in index)
    denoiser = DENOISERS[component].from_pretrained(directory / component)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(directory / "scheduler")
    config = json.loads((directory / "text_encoder" / "config.json").read_text())
    text_encoder = WordEncoder(config["vocab_size"], config["dim"], config["length"])
    text_encoder.load_state_dict(load_file(directory / "text_encoder" / "model.safetensors"))
    vocabulary = tuple(json.loads((directory / "vocabulary.json").read_text()))
    if len(vocabulary) != config["vocab_size"]:
        raise ValueError(
            f"{directory}: vocabulary.json has {len(vocabulary)} words but the text encoder "
            f"embeds {config['vocab_size']}; save the model again with save_image_model"
        )
    model = ImageModel(denoiser, text_encoder, scheduler, vocabulary, index["image_size"])
    return model.to(torch.float32).eval()


def preset_summary(preset: str) -> dict:
    """The preset's sizes and its parameter count, for logs and reports."""
    return {**asdict(PRESETS[preset]), "parameters": count_parameters(build_image_model(preset, 0))}
