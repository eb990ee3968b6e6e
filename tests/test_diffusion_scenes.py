"""Diffusion RL's data and reward: scene prompts round-trip and embed as word ids, the held-out
split keeps (colour, shape) pairs unseen, the renderer is seeded and keeps to the named half,
and the checker accepts every rendered scene and rejects each wrong attribute on its own."""

import dataclasses

import numpy as np
import pytest

import miles_core.diffusion.render as render_module
from miles_core.diffusion.checker import check
from miles_core.diffusion.render import MIN_SIZE, half_bounds, render, render_batch
from miles_core.diffusion.scenes import (
    COLOURS,
    COUNTS,
    HELD_OUT_PAIRS,
    SHAPES,
    VOCABULARY,
    Scene,
    all_scenes,
    prompt_ids,
    split_scenes,
)

SCENES = all_scenes()
OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def test_every_prompt_round_trips_and_embeds_as_word_ids():
    assert len(SCENES) == len(set(SCENES)) == 4 * 3 * 3 * 4
    assert Scene(2, "red", "square", "left").prompt == "two red squares on the left"
    assert Scene(1, "blue", "circle", "top").prompt == "one blue circle at the top"
    for scene in SCENES:
        assert Scene.parse(scene.prompt) == scene
        ids = prompt_ids(scene.prompt)
        assert len(ids) == 6 and " ".join(VOCABULARY[i] for i in ids) == scene.prompt
    assert len(set(VOCABULARY)) == len(VOCABULARY)


def test_text_outside_the_grammar_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown word 'purple'.*'red'"):
        prompt_ids("two purple squares on the left")
    with pytest.raises(ValueError, match="unknown word 'hexagons'"):
        Scene.parse("two red hexagons on the left")
    with pytest.raises(ValueError, match="'square' after 'two'"):
        Scene.parse("two red square on the left")
    with pytest.raises(ValueError, match="'at the top'"):
        Scene.parse("two red squares on the top")
    with pytest.raises(ValueError, match="expected 6"):
        Scene.parse("two red squares")
    with pytest.raises(ValueError, match="count 4"):
        Scene(4, "red", "square", "left")


def test_split_holds_out_whole_colour_shape_pairs():
    train, held_out = split_scenes()
    assert not set(train) & set(held_out)
    assert sorted(train + held_out, key=SCENES.index) == SCENES
    assert {s.colour for s in train} == set(COLOURS) and {s.shape for s in train} == set(SHAPES)
    assert {(s.colour, s.shape) for s in held_out} == set(HELD_OUT_PAIRS)
    assert not {(s.colour, s.shape) for s in train} & set(HELD_OUT_PAIRS)
    assert len(held_out) == len(SCENES) // 4
    assert split_scenes() == (train, held_out)


def test_rendering_is_seeded_and_keeps_to_the_named_half():
    scene = Scene(3, "yellow", "triangle", "bottom")
    image = render(scene, 32, 7)
    assert image.dtype == np.float32 and image.shape == (3, 32, 32)
    assert image.min() == -1.0 and image.max() == 1.0
    assert np.array_equal(image, render(scene, 32, np.random.default_rng(7)))
    assert not np.array_equal(image, render(scene, 32, 8))
    for scene in SCENES:
        image = render(scene, 32, 1)
        r0, r1, c0, c1 = half_bounds(scene.position, 32)
        outside = np.ones((32, 32), dtype=bool)
        outside[r0:r1, c0:c1] = False
        assert (image[:, outside] == -1).all() and (image[:, ~outside] > -1).any()
    batch = render_batch(SCENES[:5], 32, seed=3)
    assert batch.shape == (5, 3, 32, 32)
    assert np.array_equal(render_batch(SCENES[:2], 32, seed=3), batch[:2])


@pytest.mark.parametrize("size", [MIN_SIZE, 32, 64])
def test_the_checker_accepts_every_rendered_scene(size):
    seeds = range(4) if size == 32 else range(1)
    for scene in SCENES:
        for seed in seeds:
            result = check(render(scene, size, seed), scene)
            assert result["all"] == result["reward"] == result["shaped"] == 1.0, (scene, result)


def test_the_stacked_fallback_layout_is_accepted_too(monkeypatch):
    monkeypatch.setattr(render_module, "_TRIES", 0)  # no random layout: always the fallback
    for scene in SCENES:
        assert check(render(scene, MIN_SIZE, 0), scene)["all"] == 1.0, scene


def test_each_wrong_attribute_scores_zero_on_its_own():
    for scene in SCENES:
        image = render(scene, 32, 5)
        wrong = {
            "count": [c for c in COUNTS if c != scene.count],
            "colour": [c for c in COLOURS if c != scene.colour],
            "shape": [s for s in SHAPES if s != scene.shape],
            "position": [OPPOSITE[scene.position]],
        }
        for attribute, values in wrong.items():
            for value in values:
                asked = dataclasses.replace(scene, **{attribute: value})
                result = check(image, asked)
                assert result[attribute] == 0.0 and result["all"] == 0.0, (scene, asked)
                if attribute != "colour":  # a wrong colour finds no objects at all
                    others = [a for a in wrong if a != attribute]
                    assert all(result[a] == 1.0 for a in others), (scene, asked, result)
                    assert result["reward"] == 0.75
                    # partial credit: a count off by k keeps 1 − k/3 of its share
                    if attribute == "count":
                        off = abs(value - scene.count) / 3
                        assert result["shaped"] == pytest.approx(1 - off / 4), (scene, asked)
                    assert 0.75 <= result["shaped"] < 1.0, (scene, asked, result)


def test_blank_and_noise_images_score_nothing():
    blank = np.full((3, 32, 32), -1.0, dtype=np.float32)
    noise = np.random.default_rng(0).uniform(-1, 1, (3, 32, 32)).astype(np.float32)
    for scene in SCENES:
        assert check(blank, scene)["reward"] == check(blank, scene)["shaped"] == 0.0
        assert check(noise, scene)["all"] == 0.0
        assert check(noise * 3, scene)["all"] == 0.0  # out of range: clipped


def test_too_small_an_image_is_refused_with_the_minimum():
    with pytest.raises(ValueError, match=f"use size >= {MIN_SIZE}"):
        render(SCENES[0], MIN_SIZE - 1, 0)
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        check(np.zeros((32, 32)), SCENES[0])
