"""Built-in synthetic data of the pipeline: the ``case`` task (``builtin:case``).

A prompt asks for a short line about a topic in capital or in small letters:

    "Describe the moon. Use capital letters."  ->  "THE MOON IS CALM."   (follows the constraint)
                                               ->  "the moon is calm."   (does not)

Why this task: the preference is a property of the *text* that a reward model can read (the
case of the response against the instruction's word), it cannot be solved by looking at the
response alone (each case is right for half of the prompts), and a rule
(:func:`follows_case`) gives the ground truth, so the pipeline can check that the reward model
and PPO moved the policy towards the real constraint and not an artefact.

- SFT pairs (:func:`case_sft_pairs`) teach the language of the task with a response in the
  requested case only ``follow_rate`` of the time (0.5: the SFT policy follows the constraint
  at chance), so any later gain in the follow rate is the reward model's and PPO's doing.
- Preference pairs (:func:`case_preferences`): a sentence in the requested case (chosen)
  against the same sentence in the other case or in mixed case (rejected).
- Prompts are the 384 combinations of 48 topics, 4 phrasings and 2 styles, shuffled once with a
  fixed seed: the first 256 (``split="train"``) feed SFT and the reward model, the last 128
  (``split="heldout"``) are never seen by either and are what PPO trains and evaluates on.

Everything is deterministic in ``seed`` (private NumPy generators; the global RNGs are
untouched). The file imports nothing from ``textrl`` so that it also loads as a reward file
(``textrl/envs/synthetic.py:case_follow_reward``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TOPICS = (
    "sea", "sky", "rain", "sun", "moon", "cat", "dog", "tree", "city", "road", "river", "book",
    "song", "cake", "tea", "bird", "snow", "wind", "lake", "hill", "star", "fish", "park", "train",
    "ship", "door", "house", "bread", "milk", "apple", "lamp", "clock", "chair", "cloud", "storm",
    "field", "grass", "stone", "bell", "boat", "shoe", "coat", "fire", "leaf", "rose", "king",
    "wolf", "bear",
)  # fmt: skip
ADJECTIVES = ("calm", "blue", "warm", "cold", "old", "new", "dark", "quiet", "green", "soft",
              "loud", "sweet")
PHRASINGS = (
    "Write about the {topic} in {style} letters.",
    "Describe the {topic}. Use {style} letters.",
    "Say something about the {topic}, in {style} letters.",
    "Tell me about the {topic} using {style} letters.",
)
SENTENCES = ("the {topic} is {adj}.", "a {adj} {topic}.", "i like the {topic}.",
             "my {topic} is {adj}.")
STYLES = ("capital", "small")
TASK_SEED = 0
TRAIN_PROMPTS = 256
"""The first 256 shuffled prompts train SFT and the reward model; the other 128 are held out."""


def case_style(prompt: str) -> str:
    """The style a ``case`` prompt asks for: ``'capital'`` or ``'small'``.

    >>> case_style("Describe the moon. Use capital letters.")
    'capital'
    """
    return "capital" if " capital letters" in prompt else "small"


def in_style(text: str, style: str) -> str:
    """``text`` written in ``style``.

    >>> in_style("the moon is calm.", "capital")
    'THE MOON IS CALM.'
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r}: must be one of {', '.join(STYLES)}")
    return text.upper() if style == "capital" else text.lower()


def other_style(style: str) -> str:
    return "small" if style == "capital" else "capital"


def follows_case(completion: str, style: str) -> bool:
    """Whether the completion has letters and every letter is in the requested case.

    >>> follows_case("THE MOON IS CALM.", "capital"), follows_case("THE moon", "capital")
    (True, False)
    >>> follows_case("...", "small")
    False
    """
    letters = [c for c in completion if c.isalpha()]
    if not letters:
        return False
    return all(c.isupper() for c in letters) if style == "capital" else all(
        c.islower() for c in letters
    )


def case_follow_reward(prompts: list[str], completions: list[str], **fields: Any) -> torch.Tensor:
    """1.0 where a completion follows its ``case`` prompt's letter-case constraint, else 0.0.

    The rule behind the built-in preferences: used in the pipeline with weight 0, so it is
    logged as ``reward_components/case_follow_reward`` without being optimised.

    >>> case_follow_reward(["Describe the sky. Use small letters."] * 2,
    ...                    ["the sky is blue.", "THE SKY IS BLUE."]).tolist()
    [1.0, 0.0]
    """
    scores = [float(follows_case(c, case_style(p))) for p, c in zip(prompts, completions)]
    return torch.tensor(scores, dtype=torch.float32)


def case_prompts(split: str = "all") -> list[dict[str, str]]:
    """Rows ``{"prompt": ..., "style": ..., "topic": ...}`` of ``split``: train | heldout | all.

    >>> len(case_prompts("train")), len(case_prompts("heldout")), len(case_prompts())
    (256, 128, 384)
    """
    rows = [
        {"prompt": phrasing.format(topic=topic, style=style), "style": style, "topic": topic}
        for topic in TOPICS
        for phrasing in PHRASINGS
        for style in STYLES
    ]
    order = np.random.default_rng(TASK_SEED).permutation(len(rows))
    rows = [rows[i] for i in order]
    if split == "train":
        return rows[:TRAIN_PROMPTS]
    if split == "heldout":
        return rows[TRAIN_PROMPTS:]
    if split == "all":
        return rows
    raise ValueError(f"split={split!r}: must be one of train, heldout, all")


def _sentence(rng: np.random.Generator, topic: str) -> str:
    template = SENTENCES[int(rng.integers(len(SENTENCES)))]
    return template.format(topic=topic, adj=ADJECTIVES[int(rng.integers(len(ADJECTIVES)))])


def case_sft_pairs(
    n: int = 1024, *, follow_rate: float = 0.5, seed: int = 0, split: str = "train"
) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "response"}`` cycling over the prompts of ``split``; each
    response is in the requested case with probability ``follow_rate``, else in the other one.

    >>> rows = case_sft_pairs(4, follow_rate=1.0)
    >>> all(follows_case(r["response"], case_style(r["prompt"])) for r in rows)
    True
    """
    if n < 1:
        raise ValueError(f"case_sft_pairs: n={n}: must be >= 1")
    if not 0.0 <= follow_rate <= 1.0:
        raise ValueError(f"case_sft_pairs: follow_rate={follow_rate!r}: must lie in [0, 1]")
    prompts = case_prompts(split)
    rng = np.random.default_rng([seed, 0xC05E])
    rows = []
    for i in range(n):
        row = prompts[i % len(prompts)]
        follow = rng.random() < follow_rate
        style = row["style"] if follow else other_style(row["style"])
        rows.append({"prompt": row["prompt"], "response": in_style(_sentence(rng, row["topic"]), style)})
    return rows


def mixed_case(text: str, style: str, rng: np.random.Generator) -> str:
    """``text`` cut at a random point between two letters, one side in ``style`` and the other
    side not: it breaks the constraint while looking half right.

    >>> mixed_case("the sea", "capital", np.random.default_rng(0)) in {"THE SEa", "the seA"}
    True
    """
    letters = [i for i, c in enumerate(text) if c.isalpha()]
    cut = letters[int(rng.integers(1, len(letters)))]  # both sides keep at least one letter
    head, tail = text[:cut], text[cut:]
    if rng.random() < 0.5:
        return in_style(head, style) + in_style(tail, other_style(style))
    return in_style(head, other_style(style)) + in_style(tail, style)


def case_preferences(*, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    """One ``{"prompt", "chosen", "rejected"}`` row per prompt of ``split``: a sentence in the
    requested case (chosen) against the same sentence wholly in the other case (half of the
    rows) or in mixed case (:func:`mixed_case`, the other half).

    Without the mixed-case half, a reward model may judge the case by the response's last tokens
    alone, and PPO then learns to start in the wrong case and end in the right one.

    >>> row = case_preferences()[0]
    >>> follows_case(row["chosen"], case_style(row["prompt"]))
    True
    >>> row["chosen"].lower() == row["rejected"].lower()
    True
    """
    rng = np.random.default_rng([seed, 0x9AE5])
    rows = []
    for i, row in enumerate(case_prompts(split)):
        sentence = _sentence(rng, row["topic"])
        style = row["style"]
        rejected = in_style(sentence, other_style(style)) if i % 2 else mixed_case(sentence, style, rng)
        rows.append({"prompt": row["prompt"], "chosen": in_style(sentence, style), "rejected": rejected})
    return rows


BUILTIN_SFT = {"case": lambda: case_sft_pairs()}
"""``builtin:NAME`` sources of SFT rows ``{"prompt", "response"}``."""
BUILTIN_PREFERENCES = {
    "case": lambda: case_preferences(split="train"),
    "case-heldout": lambda: case_preferences(split="heldout"),
}
"""``builtin:NAME`` sources of preference rows ``{"prompt", "chosen", "rejected"}``."""
BUILTIN_PROMPTS = {"case": lambda: case_prompts("heldout")}
"""``builtin:NAME`` prompt sets for PPO (prompts that SFT and the reward model never saw)."""

__all__ = [
    "BUILTIN_PREFERENCES",
    "BUILTIN_PROMPTS",
    "BUILTIN_SFT",
    "case_follow_reward",
    "case_preferences",
    "case_prompts",
    "case_sft_pairs",
    "case_style",
    "follows_case",
    "in_style",
]
