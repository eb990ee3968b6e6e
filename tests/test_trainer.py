import random

import pytest
import torch

from miles_core.config import RunConfig
from miles_core.engines.cpu.embedded import EmbeddedEngine
from miles_core.engines.wire import GenerateRequest, SamplingParams
from miles_core.rollout.rollout_fn import encode_prompt
from miles_core.train.advantage import ADVANTAGES
from miles_core.train.backends.fsdp import FSDPBackend
from miles_core.train.batch import PaddedBatch, TrainBatch
from miles_core.train.forward import LossNeeds
from miles_core.train.loss_terms import aggregate, k3_kl, ppo_clip_loss
from miles_core.train.losses.policy import PolicyOptions
from miles_core.train.padding import pad_rows
from miles_core.train.shared_prefix import SharedPrefix
from miles_core.types import Sample, SampleGroup
from miles_core.weights import TRANSPORTS, mismatched_tensors


def _trainer(model_dir, **overrides):
    loss = {k: overrides.pop(k) for k in list(overrides) if k in PolicyOptions.model_fields}
    update = {"micro_batch_size": 8, "loss_options": PolicyOptions(**loss), **overrides}
    cfg = RunConfig().train.model_copy(update=update)
    return FSDPBackend(
        str(model_dir), optim=cfg.model_dump(), loss=cfg.model_dump(), total_steps=10
    )


def _rollout(engine, tok, n=16, seed=0, temperature=1.0):
    rng = random.Random(seed)
    prompts = ["say a", "reverse abcdef", "12+34=", "go"]
    reqs = [
        GenerateRequest(
            input_ids=encode_prompt(tok, rng.choice(prompts)),
            sampling_params=SamplingParams(
                max_new_tokens=rng.randint(3, 12),
                stop_token_ids=[tok.eos_token_id],
                temperature=temperature,
            ),
        )
        for _ in range(n)
    ]
    out = engine.generate(reqs)
    return TrainBatch(
        tokens=[q.input_ids + r.output_ids for q, r in zip(reqs, out, strict=True)],
        response_lengths=[len(r.output_ids) for r in out],
        loss_masks=[[1] * len(r.output_ids) for r in out],
        advantages=[rng.gauss(0, 1) for _ in out],
        rollout_log_probs=[r.output_log_probs for r in out],
        temperature=temperature,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_recompute_matches_engine_logprobs(tiny_dir, tiny, temperature):
    model, tok = tiny
    batch = _rollout(EmbeddedEngine(model, tok, seed=0), tok, temperature=temperature)
    recomputed = _trainer(tiny_dir).compute_log_probs(batch)
    diffs = [
        abs(a - b)
        for r, o in zip(recomputed, batch.rollout_log_probs, strict=True)
        for a, b in zip(r, o, strict=True)
    ]
    assert len(diffs) == sum(batch.response_lengths)
    assert max(diffs) < 1e-5


def test_shared_prompt_forward_gives_the_padded_rows_log_probs_and_update(tiny_dir, tiny):
    model, tok = tiny
    batch = _rollout(EmbeddedEngine(model, tok, seed=0), tok)
    # edge rows: a one-token response, and a zero-length one (a failed episode's placeholder)
    prompt = encode_prompt(tok, "go")
    batch.tokens += [prompt + [tok.eos_token_id], list(prompt)]
    batch.response_lengths += [1, 0]
    batch.loss_masks += [[1], []]
    batch.advantages += [0.5, 0.0]
    batch.rollout_log_probs += [[-1.0], []]
    layout = SharedPrefix.build(batch.slice(0, 8), pad_id=0)
    assert layout is not None and layout.saved_tokens > 0  # the micro-batch does share prompts
    shared, padded = (
        _trainer(tiny_dir, micro_batch_size=9),
        _trainer(tiny_dir, micro_batch_size=9, share_prompts=False),
    )
    assert shared.micro_batch(batch.slice(0, 9)).prefix is not None
    assert padded.micro_batch(batch.slice(0, 9)).prefix is None
    a, b = shared.compute_log_probs(batch), padded.compute_log_probs(batch)
    assert [len(r) for r in a] == [len(r) for r in b] == batch.response_lengths
    assert (
        max(abs(x - y) for r, o in zip(a, b, strict=True) for x, y in zip(r, o, strict=True)) < 1e-5
    )
    grads = []
    for trainer in (shared, padded):  # the gradient of one micro-batch's policy-gradient sum
        mb = trainer.micro_batch(batch.slice(0, 9))
        out = trainer.forward(mb, LossNeeds())
        (out.log_probs * mb.mask * mb.per_row(batch.advantages[:9]).unsqueeze(1)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        trainer.model.zero_grad(set_to_none=True)
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], atol=1e-6, rtol=1e-4), n
    assert any(g.abs().max() > 1e-3 for g in grads[0].values())
    batch.old_is_current = True
    ma, mb = shared.train_step(batch), padded.train_step(batch)
    for key in ("loss", "pg_loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-7), key


def test_shared_prompt_layout_applies_only_where_it_saves():
    distinct = TrainBatch(
        tokens=[[1, 2, 3], [1, 4, 5]], response_lengths=[1, 1], loss_masks=[[1]] * 2
    )
    assert SharedPrefix.build(distinct, 0) is None  # prompts [1, 2] and [1, 4]: nothing shared
    no_prompt = TrainBatch(
        tokens=[[1, 2], [1, 2]], response_lengths=[2, 2], loss_masks=[[1, 1]] * 2
    )
    assert SharedPrefix.build(no_prompt, 0) is None  # no token to predict the first one from
    twins = TrainBatch(
        tokens=[[7, 8, 1], [7, 8, 2, 3]], response_lengths=[1, 2], loss_masks=[[1], [1, 1]]
    )
    layout = SharedPrefix.build(twins, 0)
    assert layout.prefix_ids.tolist() == [[7, 8]] and layout.row_prompt.tolist() == [0, 0]
    assert layout.suffix_ids.tolist() == [[0], [2]] and layout.suffix_positions.tolist() == [
        [2],
        [2],
    ]
    assert layout.saved_tokens == 2


def test_step_zero_is_exactly_on_policy_then_weights_move_and_sync_bitwise(tiny_dir, tiny):
    model, tok = tiny
    engine = EmbeddedEngine(type(model).from_pretrained(tiny_dir), tok, seed=0)
    trainer = _trainer(tiny_dir)
    batch = _rollout(engine, tok)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    before = {n: t.clone() for n, t in engine.named_tensors().items()}
    m = trainer.train_step(batch)
    assert m["ppo_kl"] == 0.0
    assert m["pg_clipfrac"] == 0.0
    assert m["train_rollout_logprob_abs_diff"] < 1e-5
    assert m["grad_norm"] > 0 and m["lr"] == pytest.approx(1e-3)

    transport = TRANSPORTS.get("colocated")(bucket_bytes=1 << 16)
    transport.connect([engine])
    stats = transport.push(trainer, version=1)
    assert engine.weight_version == 1 and stats.bytes > 0
    expected = [x for b in trainer.named_weights() for x in b]
    assert {n for n, _ in expected} == set(engine.named_tensors())
    assert mismatched_tensors(expected, engine.named_tensors()) == []
    assert any(not torch.equal(before[n], t) for n, t in expected)
    # a second step on the same (now off-policy) batch sees a non-zero KL
    assert trainer.train_step(batch)["ppo_kl"] != 0.0


def test_sft_loss_goes_down(tiny_dir, tiny):
    _, tok = tiny
    trainer = _trainer(tiny_dir, lr=1e-2)
    prompt = encode_prompt(tok, "say a")
    answer = tok.encode("aaaa", add_special_tokens=False) + [tok.eos_token_id]
    batch = TrainBatch(
        tokens=[prompt + answer] * 8,
        response_lengths=[len(answer)] * 8,
        loss_masks=[[1] * len(answer)] * 8,
    )
    losses = [trainer.train_step(batch, loss="sft")["loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_kl_to_reference_is_zero_at_start_and_grows(tiny_dir, tiny):
    model, tok = tiny
    trainer = _trainer(tiny_dir, kl_coef=0.1, lr=1e-2)
    batch = _rollout(EmbeddedEngine(model, tok, seed=1), tok)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    first = trainer.train_step(batch)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-12)
    for _ in range(3):
        last = trainer.train_step(batch)
    assert last["kl_loss"] > 1e-6


GRPO = ADVANTAGES.get("grpo")
RLOO = ADVANTAGES.get("rloo")
NORMALISED, CENTRED = GRPO.Options(), GRPO.Options(normalize_std=False)


def grpo_advantages(groups, normalize_std=True):
    return GRPO(groups, NORMALISED if normalize_std else CENTRED)


def test_grpo_advantages_are_group_normalised():
    def group(i, rewards):
        return SampleGroup(
            i, [Sample(i, k, f"r{k}", "p", [1], 0, [], [], reward=r) for k, r in enumerate(rewards)]
        )

    adv = grpo_advantages([group(0, [1.0, 0.0, 1.0, 0.0]), group(1, [0.5, 0.5])])
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item()
    assert adv[:4] == pytest.approx([0.5 / std, -0.5 / std, 0.5 / std, -0.5 / std], rel=1e-5)
    assert adv[4:] == [0.0, 0.0]
    assert grpo_advantages([group(0, [2.0, 0.0])], normalize_std=False) == [1.0, -1.0]


def test_grpo_baselines_count_each_rollout_once_and_leaves_share_its_advantage():
    def leaf(rollout, reward):
        return Sample(0, 0, rollout, "p", [1], 0, [], [], reward=reward)

    # episode a: 3 leaves, reward 1; b: 1 leaf, reward 0 → the baseline is 0.5, not 0.75
    group = SampleGroup(0, [leaf("a", 1.0), leaf("a", 1.0), leaf("b", 0.0), leaf("a", 1.0)])
    assert grpo_advantages([group], normalize_std=False) == [0.5, 0.5, -0.5, 0.5]
    std = torch.tensor([1.0, 0.0], dtype=torch.float64).std().item()
    expected = [0.5 / std] * 2 + [-0.5 / std, 0.5 / std]
    assert grpo_advantages([group]) == pytest.approx(expected, rel=1e-5)


def test_failed_samples_are_not_part_of_the_baseline():
    from miles_core.types import Status

    def sample(k, reward, status=Status.COMPLETED):
        return Sample(0, k, f"r{k}", "p", [1], 0, [], [], reward=reward, status=status)

    group = SampleGroup(0, [sample(0, 1.0), sample(1, 0.0, Status.FAILED), sample(2, 0.0)])
    assert grpo_advantages([group], normalize_std=False) == [0.5, 0.0, -0.5]
    all_failed = SampleGroup(1, [sample(0, 0.0, Status.FAILED), sample(1, 0.0, Status.FAILED)])
    assert grpo_advantages([all_failed]) == [0.0, 0.0]


def test_rloo_subtracts_the_mean_of_the_other_rollouts_of_the_group():
    def sample(k, rollout, reward):
        return Sample(0, k, rollout, "p", [1], 0, [], [], reward=reward)

    rewards = [1.0, 0.0, 0.5, 0.25]
    group = SampleGroup(0, [sample(k, f"r{k}", r) for k, r in enumerate(rewards)])
    # r_i − mean of the other three, each computed on its own
    others = [(sum(rewards) - r) / 3 for r in rewards]
    assert RLOO([group], RLOO.Options()) == pytest.approx(
        [r - o for r, o in zip(rewards, others, strict=True)], abs=1e-12
    )
    # leaves of one rollout share its advantage; a lone rollout has no baseline
    leaves = SampleGroup(1, [sample(0, "a", 1.0), sample(1, "a", 1.0), sample(2, "b", 0.0)])
    assert RLOO([leaves], RLOO.Options()) == [1.0, 1.0, -1.0]
    assert RLOO([SampleGroup(2, [sample(0, "a", 1.0)])], RLOO.Options()) == [0.0]


def test_optimizer_steps_take_whole_rollouts():
    from miles_core.train.batch import rollout_slices

    ids = ["a", "a", "b", "c", "c", "c", "d"]
    assert rollout_slices(ids, 2) == [(0, 3), (3, 7)]
    assert rollout_slices(ids, 3) == [(0, 6), (6, 7)]
    assert rollout_slices(ids, 10) == [(0, 7)]
    assert rollout_slices([f"r{i}" for i in range(6)], 2) == [(0, 2), (2, 4), (4, 6)]
    assert rollout_slices([], 4) == []
    with pytest.raises(ValueError, match="rollout 'a': its samples are not next to each other"):
        rollout_slices(["a", "b", "a"], 1)


def test_ppo_clip_is_asymmetric_and_masks_count_in_the_numerator_only():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    adv = torch.ones(1, 3)
    loss, clipped, _ = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # ratio 1.5 clipped at 1.3 for positive advantages; 0.5 and 1.1 unclipped
    assert loss.tolist()[0] == pytest.approx([-1.3, -0.5, -1.1], rel=1e-6)
    assert clipped.tolist()[0] == [1.0, 0.0, 0.0]
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(aggregate(loss, mask, "token_mean", 4.0)) == pytest.approx((-1.3 - 0.5) / 4)
    assert float(aggregate(loss, mask, "seq_mean_token_mean", 1.0)) == pytest.approx(
        (-1.3 - 0.5) / 2
    )


def test_ppo_clip_lower_bound_for_negative_advantages():
    logp = torch.log(torch.tensor([[0.5, 1.5, 0.9]]))
    old = torch.zeros(1, 3)
    adv = -torch.ones(1, 3)
    loss, clipped, _ = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # A < 0: the ratio is floored at 1 - eps (0.8) — max(-A·r, -A·clip(r)) keeps the larger loss
    assert loss.tolist()[0] == pytest.approx([0.8, 1.5, 0.9], rel=1e-6)
    assert clipped.tolist()[0] == [1.0, 0.0, 0.0]


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    a = torch.randn(100)
    b = torch.randn(100)
    assert torch.all(k3_kl(a, b) >= 0)
    assert torch.equal(k3_kl(a, a), torch.zeros(100))


def test_rollout_mean_weighs_each_agent_session_once_however_many_leaves_it_has(tiny_dir, tiny):
    """Rollout A is one sample with advantage +1; rollout B is three sibling leaves with
    advantage −1 (a harness that spawned sub-agents). At step 0 (ratio 1) the per-token policy
    loss is −advantage, so per-rollout normalisation gives (−1 + 1) / 2 = 0, while per-sample
    normalisation lets B's three leaves outweigh A: (−1 + 3) / 4 = 0.5."""
    _, tok = tiny
    prompt = encode_prompt(tok, "go")
    lengths = [5, 3, 4, 6]
    batch = TrainBatch(
        tokens=[prompt + [10 + i] * n for i, n in enumerate(lengths)],
        response_lengths=lengths,
        loss_masks=[[1] * n for n in lengths],
        advantages=[1.0, -1.0, -1.0, -1.0],
        sample_ids=["A", "B", "B", "B"],
    )
    results = {}
    for agg in ("rollout_mean_token_mean", "seq_mean_token_mean"):
        trainer = _trainer(tiny_dir, loss_agg=agg, micro_batch_size=2)  # siblings split
        batch.old_log_probs = trainer.compute_log_probs(batch)
        results[agg] = trainer.train_step(batch)["pg_loss"]
    assert results["rollout_mean_token_mean"] == pytest.approx(0.0, abs=1e-6)
    assert results["seq_mean_token_mean"] == pytest.approx(0.5, abs=1e-6)
    rows = torch.tensor([[2.0, 2.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="rollout token total"):
        aggregate(rows, torch.ones_like(rows), "rollout_mean_token_mean", 2.0)


def test_padded_layout_holds_each_row_at_its_place_and_refuses_a_misfit():
    rows = [[5, 6, 7], [], [8]]
    assert pad_rows(rows, 4, 0, torch.long).tolist() == [[5, 6, 7, 0], [0, 0, 0, 0], [8, 0, 0, 0]]
    left = pad_rows(rows, 4, -1, torch.long, left=True).tolist()
    assert left == [[-1, 5, 6, 7], [-1, -1, -1, -1], [-1, -1, -1, 8]]
    with pytest.raises(ValueError, match="does not fit"):
        pad_rows(rows, 2, 0, torch.long)
    # prompt [1, 2] + response [3, 4]; prompt [9] + no response; prompt [1] + response [5]
    batch = TrainBatch(
        tokens=[[1, 2, 3, 4], [9], [1, 5]], response_lengths=[2, 0, 1], loss_masks=[[1, 0], [], [1]]
    )
    padded = PaddedBatch.build(batch, pad_id=0)
    assert padded.targets.tolist() == [[3, 4], [0, 0], [5, 0]]
    assert padded.targets_index.tolist() == [[1, 2], [0, 0], [0, 0]]
    assert padded.mask.tolist() == [[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]
    # the batch's per-token rows (engine log-probs, old log-probs) land beside the padded
    # tensors, wherever `.to(device)` put them (on CUDA the loss mixes both; "meta" stands in)
    assert padded.per_token([[0.5, 0.25], [], [1.0]]).tolist() == [[0.5, 0.25], [0, 0], [1, 0]]
    assert padded.to("meta").per_token([[0.5], [], []]).device.type == "meta"
    bad = TrainBatch(tokens=[[1, 2, 3]], response_lengths=[2], loss_masks=[[1]])
    with pytest.raises(ValueError, match="loss mask of 1 for 2 response tokens"):
        PaddedBatch.build(bad, pad_id=0)


def test_a_batch_that_does_not_split_over_the_ranks_gets_rows_that_train_nothing():
    from miles_core.train.step import shard

    batch = TrainBatch(
        tokens=[[1, 2, 3 + i] for i in range(5)],
        response_lengths=[1] * 5,
        loss_masks=[[1]] * 5,
        advantages=[0.5, -0.5, 1.0, -1.0, 2.0],
        sample_ids=["a", "a", "b", "c", "c"],
    )
    batch, rollouts = batch.with_rollout_tokens()
    parts = [shard(batch, rank, 2) for rank in range(2)]
    assert [len(p) for p in parts] == [3, 3] and rollouts == 3
    inert = parts[1].slice(2, 3)  # the sixth row: a copy of the last that trains nothing
    assert inert.loss_masks == [[0]] and inert.advantages == [0.0]
    assert inert.sample_ids == ["c"] and inert.rollout_tokens == [2.0]  # no rollout, no token
    real = parts[0].tokens + parts[1].tokens[:2]
    assert real == batch.tokens  # every row once, in order
    assert shard(batch, 0, 1).tokens == batch.tokens  # one rank: the batch as it is
