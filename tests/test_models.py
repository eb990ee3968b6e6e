import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_core.models import PRESETS, build_model, count_parameters, save_hf_dir
from miles_core.models.tokenizer import IM_END, IM_START


def test_presets_have_the_promised_sizes():
    sizes = {name: count_parameters(build_model(name, seed=0)[0]) for name in PRESETS}
    assert 100_000 <= sizes["tiny"] <= 200_000
    assert 3_500_000 <= sizes["small"] <= 4_500_000
    assert 25_000_000 <= sizes["medium"] <= 35_000_000


def test_same_seed_same_weights_other_seed_other_weights():
    a, _ = build_model("tiny", seed=3)
    b, _ = build_model("tiny", seed=3)
    c, _ = build_model("tiny", seed=4)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )


def test_saved_hf_dir_reloads_offline_to_identical_logits(tmp_path):
    model, tok = build_model("small", seed=1)
    save_hf_dir(model, tok, tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([tok2.encode("reverse abcd", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert again.config.model_type == "qwen3"


def test_tokenizer_is_character_level_with_single_id_specials(tiny):
    _, tok = tiny
    assert tok.encode("abc", add_special_tokens=False) == [
        tok.convert_tokens_to_ids(c) for c in "abc"
    ]
    assert len(tok.encode(IM_START, add_special_tokens=False)) == 1
    assert tok.eos_token == IM_END
    text = "x = 1 + 2\n\tprint(x)!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_prefix_stable_across_turns(tiny):
    _, tok = tiny
    turn1 = [{"role": "user", "content": "hi"}]
    p1 = tok.apply_chat_template(turn1, add_generation_prompt=True, tokenize=False)
    reply = "ok"
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    p2 = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=False)
    ids1 = tok.encode(p1, add_special_tokens=False) + tok.encode(reply, add_special_tokens=False)
    ids1 += [tok.eos_token_id]
    assert tok.encode(p2, add_special_tokens=False)[: len(ids1)] == ids1
