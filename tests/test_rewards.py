"""Tests for nebula_rl.rewards: each reward, the registry, combinations and running in pools."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from nebula_rl.rewards import (
    REWARDS,
    CombinedReward,
    answer_format_reward,
    arithmetic_reward,
    boxed_math_reward,
    combine_rewards,
    direct_math_reward,
    get_reward,
    gsm8k_reward,
    overlong_penalty,
    register_reward,
)
from nebula_rl.rewards.extract import last_boxed

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"


@register_reward("test_length")
def length_reward(completion: str, reference: str) -> float:
    """A user reward registered by name: 1.0 when the completion is as long as the reference."""
    return 1.0 if len(completion) == len(reference) else 0.0


def starts_with_reward(completion: str, reference: str) -> float:
    """A user reward loaded by import path only: 1.0 when the completion starts with the reference."""
    return 1.0 if completion.startswith(reference) else 0.0


# (reward name, completion, reference, expected reward): one right and one wrong per reward.
CASES = [
    ("boxed_math", r"so the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    ("boxed_math", r"so the answer is \boxed{3}.", "0.5", 0.0),
    ("direct_math", "Adding them up, the answer is 1/2", r"\frac{1}{2}", 1.0),
    ("direct_math", "Adding them up, the answer is 7", r"\frac{1}{2}", 0.0),
    ("gsm8k", "She makes 9 * 2 = 18 dollars.\n#### 18", "9*2=18\n#### 18", 1.0),
    ("gsm8k", "She makes 9 * 3 = 27 dollars.\n#### 27", "9*2=18\n#### 18", 0.0),
    ("answer_format", r"The answer is \boxed{4}.", "5", 1.0),
    ("answer_format", "The answer is 4.", "5", 0.0),
    ("format", "<think>two red, one blue</think>\n\n<answer>3</answer>", "5", 1.0),
    ("format", "<think>a</think>\n\n<answer>B</answer>\n", "B", 1.0),  # a final newline
    ("format", "<think>a</think> <answer>B</answer>", "B", 0.0),  # the prompt's own spacing
    ("format", "<think>a<think>b</think>\n\n<answer>B</answer>", "B", 0.0),  # nested think
    ("format", "Sure. <think>a</think>\n\n<answer>B</answer>", "B", 0.0),  # text before
    ("format", "<think>a</think>\n\n<answer>B</answer> done", "B", 0.0),  # text after
    ("single_choice", "<think>the arm moves left</think>\n\n<answer> b </answer>", "B", 1.0),
    ("single_choice", "<answer>C</answer>", "<answer>B</answer>", 0.0),
    ("single_choice", " (b) ", "(B)", 1.0),  # no tags: the whole text
    ("single_choice", "<answer>B</answer><answer>C</answer>", "B", 1.0),  # the first answer
    ("arithmetic", "12\n", "12", 1.0),
    ("arithmetic", "13", "12", 0.0),
    ("test_length", "abc", "xyz", 1.0),
    ("test_length", "abcd", "xyz", 0.0),
]


def _run_case(case: tuple[str, str, str, float]) -> float:
    name, completion, reference, _ = case
    return REWARDS[name](completion, reference)


# --- boxed_math / direct_math ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"\boxed{1/2}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\frac{1}{2}}", "1/2"),
        (r"\boxed{\dfrac{1}{2}}", "$0.5$"),
        (r"\boxed{(1,2)}", "(1, 2)"),
        (r"\boxed{x^2 + 1}", "1 + x^2"),
        (r"\boxed{\dfrac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{1,000}", "1000"),
        (r"Try \boxed{2} first. No: \boxed{3}", "3"),
        (r"\boxed{3}", r"We find $x = 1 + 2$, so the answer is \boxed{3}."),
    ],
)
def test_boxed_math_accepts_equivalent_forms(completion: str, reference: str) -> None:
    assert boxed_math_reward(completion, reference) == 1.0


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"\boxed{1/3}", "0.5"),
        (r"\boxed{(1,2]}", "(1, 2)"),
        (r"Final: \boxed{3}. Oops, \boxed{2}", "3"),  # only the last box counts
        ("The answer is 1/2 but I will not box it", "1/2"),
        (r"\boxed{\frac{1}{2}", "1/2"),  # never closed
        (r"\boxed{}", "0"),
        ("", "1"),
        (r"\boxed{\frac{\frac{}}", "1"),
        ("\\boxed{\x00\\\\}}}{{{$$$", "1"),
        (r"\boxed{1/2}", ""),
    ],
)
def test_boxed_math_rejects_wrong_and_malformed(completion: str, reference: str) -> None:
    assert boxed_math_reward(completion, reference) == 0.0


def test_last_boxed_matches_braces() -> None:
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{2}}} c") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"so \boxed 5$.") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("no box") is None


def test_direct_math() -> None:
    assert direct_math_reward("Therefore the final answer is 0.5", r"\frac{1}{2}") == 1.0
    assert direct_math_reward(r"We get $x = \frac{2}{4}$.", "0.5") == 1.0
    assert direct_math_reward("First we get 3, then 12", "12") == 1.0
    assert direct_math_reward(r"It is \boxed{\sqrt{4}}", "2") == 1.0
    assert direct_math_reward("First we get 12, then 3", "12") == 0.0
    assert direct_math_reward("I do not know", "12") == 0.0
    assert direct_math_reward("", "12") == 0.0
    assert direct_math_reward("}{$$\\frac{", "12") == 0.0


def test_math_timeout_in_main_thread() -> None:
    # Without a working timeout, comparing this tower of powers runs for minutes; a subprocess
    # lets the test fail (rather than hang) if the timeout is not applied.
    code = (
        "from nebula_rl.rewards import boxed_math_reward, math_answer\n"
        "math_answer.PARSE_TIMEOUT_S = math_answer.VERIFY_TIMEOUT_S = 1\n"
        "print(boxed_math_reward(r'\\boxed{9^{9^{9^{9}}}}', '2'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True
    )
    assert result.stdout.strip() == "0.0"


# --- gsm8k ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("#### 1,000", "#### 1000", 1.0),
        ("#### $1,000.", "Total: 10*100=<<10*100=1000>>1000\n#### 1,000", 1.0),
        ("It costs $18.00.", "#### 18", 1.0),
        ("the answer is 18.", "18", 1.0),  # reference without "####" is the number itself
        (r"\boxed{\$1,234}", "#### 1234", 1.0),
        (r"\boxed{2 \times 9 = 18}", "#### 18", 1.0),
        ("#### 18\nCheck: 18 - 4 = 14", "#### 18", 1.0),  # "####" beats the last number
        ("10-2=8", "#### 8", 1.0),
        ("It dropped by -5 degrees", "#### -5", 1.0),
        ("#### 17", "#### 18", 0.0),
        ("18 eggs, so 36 in total", "#### 18", 0.0),  # the last number counts
        (r"\boxed{18} but really 20", "#### 20", 0.0),  # the box beats the last number
        ("#### ", "#### 18", 0.0),
        ("no numbers here", "#### 18", 0.0),
        ("", "#### 18", 0.0),
        ("#### 1,00", "#### 100", 0.0),  # not a thousands group
    ],
)
def test_gsm8k(completion: str, reference: str, expected: float) -> None:
    assert gsm8k_reward(completion, reference) == expected


def test_gsm8k_bad_reference_is_an_error() -> None:
    with pytest.raises(ValueError, match="gsm8k reference"):
        gsm8k_reward("#### 3", "three apples\n#### three")


def test_gsm8k_on_dataset_gold_answers() -> None:
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:200]]
    assert len(rows) == 200
    for row in rows:
        reference = row["answer"]
        gold = int(reference.split("####")[-1].strip().replace(",", ""))
        assert gsm8k_reward(reference, reference) == 1.0, reference
        assert gsm8k_reward(f"So the total is {gold}.\n#### {gold:,}", reference) == 1.0
        assert gsm8k_reward(f"So the total is {gold}.\n#### {gold + 1}", reference) == 0.0


# --- format / arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"\boxed{3}", 1.0),
        (r"so \boxed{x+1}.", 1.0),
        ("work\n#### 4", 1.0),
        ("#### $1,000", 1.0),
        ("4", 0.0),
        (r"\boxed{}", 0.0),
        (r"\boxed{3", 0.0),
        ("#### four", 0.0),
        ("", 0.0),
    ],
)
def test_answer_format(completion: str, expected: float) -> None:
    assert answer_format_reward(completion, "ignored") == expected


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("12", "12", 1.0),
        ("12 ", "12", 1.0),
        ("\n12\n", " 12", 1.0),
        ("-3", "-3", 1.0),
        ("012", "12", 0.0),
        ("+12", "12", 0.0),
        ("12.0", "12", 0.0),
        ("1 2", "12", 0.0),
        ("abc", "12", 0.0),
        ("", "12", 0.0),
    ],
)
def test_arithmetic(completion: str, reference: str, expected: float) -> None:
    assert arithmetic_reward(completion, reference) == expected


def test_arithmetic_bad_reference_is_an_error() -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        arithmetic_reward("12", "twelve")


# --- overlong penalty -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response_length", "expected"),
    [
        (0, 0.0),
        (768, 0.0),  # max - buffer: the last unpenalized length
        (832, -0.25),  # a quarter into the buffer
        (896, -0.5),  # midpoint
        (1023, -255 / 256),
        (1024, -1.0),  # at max
        (5000, -1.0),  # beyond max
    ],
)
def test_overlong_penalty(response_length: int, expected: float) -> None:
    penalty = overlong_penalty(response_length, max_response_length=1024, buffer_length=256)
    assert penalty == pytest.approx(expected)


def test_overlong_penalty_factor_and_zero_buffer() -> None:
    kwargs = {"max_response_length": 100, "buffer_length": 20}
    assert overlong_penalty(90, **kwargs, penalty_factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, **kwargs, penalty_factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(100, max_response_length=100, buffer_length=0) == 0.0
    assert overlong_penalty(101, max_response_length=100, buffer_length=0) == -1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_response_length": 0, "buffer_length": 0}, "max_response_length"),
        ({"max_response_length": 10, "buffer_length": 11}, "buffer_length"),
        ({"max_response_length": 10, "buffer_length": -1}, "buffer_length"),
        ({"max_response_length": 10, "buffer_length": 2, "penalty_factor": -1.0}, "penalty_factor"),
    ],
)
def test_overlong_penalty_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_penalty(5, **kwargs)


# --- registry and combinations ----------------------------------------------------------------


def test_builtin_rewards_are_registered() -> None:
    assert {"boxed_math", "direct_math", "gsm8k", "format", "answer_format", "single_choice",
            "arithmetic"} <= set(REWARDS)  # fmt: skip
    assert get_reward("gsm8k") is gsm8k_reward


def test_get_reward_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'gsm9k'.*'gsm8k'"):
        get_reward("gsm9k")


def test_user_reward_by_name() -> None:
    assert get_reward("test_length") is length_reward
    assert combine_rewards("test_length")("abc", "xyz") == 1.0


def test_user_reward_by_import_path() -> None:
    reward = get_reward(f"{__name__}:starts_with_reward")
    assert reward is starts_with_reward
    assert combine_rewards({f"{__name__}:starts_with_reward": 2.0})("#### 4", "####") == 2.0


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module"),
        (f"{__name__}:no_such_fn", "has no attribute"),
        (f"{__name__}:GSM8K_TEST", "not callable"),
        (":fn", "module.path:function"),
    ],
)
def test_bad_import_paths(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_reward(path)


def test_register_rejects_unpicklable_and_taken_names() -> None:
    with pytest.raises(ValueError, match="top-level function"):
        register_reward("test_lambda")(lambda completion, reference: 0.0)

    def local_reward(completion: str, reference: str) -> float:
        return 0.0

    with pytest.raises(ValueError, match="top-level function"):
        register_reward("test_local")(local_reward)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("gsm8k")(starts_with_reward)
    assert register_reward("test_length")(length_reward) is length_reward  # same fn: no-op
    assert "test_lambda" not in REWARDS
    assert "test_local" not in REWARDS


def test_combine_rewards_weights() -> None:
    completion, reference = r"So \boxed{18}", "#### 18"
    assert combine_rewards("gsm8k")(completion, reference) == 1.0
    assert combine_rewards(["gsm8k", "answer_format"])(completion, reference) == 2.0
    starts_with = f"{__name__}:starts_with_reward"
    weighted = combine_rewards({"gsm8k": 1.0, "answer_format": 0.1, starts_with: -0.5})
    assert weighted(completion, reference) == pytest.approx(1.1)
    assert weighted(r"So \boxed{17}", reference) == pytest.approx(0.1)
    assert weighted("#### 18", reference) == pytest.approx(0.6)
    assert weighted("no answer", reference) == 0.0
    assert weighted.names == ("gsm8k", "answer_format", starts_with)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ({"gsm8k": 1.0, "nope": 0.5}, ValueError, r"unknown reward 'nope'.*'gsm8k'"),
        (["gsm8k", "nope"], ValueError, "unknown reward 'nope'"),
        ([], ValueError, "at least one"),
        ({}, ValueError, "at least one"),
        (["gsm8k", "gsm8k"], ValueError, "twice"),
        ({"gsm8k": float("nan")}, ValueError, "finite"),
        ({"gsm8k": "1"}, TypeError, "must be a number"),
        (3, TypeError, "reward_function"),
    ],
)
def test_combine_rewards_rejects_bad_specs(spec: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        combine_rewards(spec)  # type: ignore[arg-type]


# --- running in pools -------------------------------------------------------------------------


def test_every_registered_reward_pickles() -> None:
    for name, reward in REWARDS.items():
        assert pickle.loads(pickle.dumps(reward)) is reward, name
    combined = combine_rewards(
        {"gsm8k": 1.0, "answer_format": 0.5, f"{__name__}:starts_with_reward": 1}
    )
    restored = pickle.loads(pickle.dumps(combined))
    assert isinstance(restored, CombinedReward)
    assert restored == combined
    assert restored(r"\boxed{18}", "#### 18") == 1.5


def test_rewards_in_thread_pool() -> None:
    # math-verify's signal timeouts raise off the main thread; the rewards must still grade.
    assert {name for name, *_ in CASES} >= {"boxed_math", "direct_math", "gsm8k", "format",
                                            "answer_format", "single_choice"}  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run_case, CASES * 2))
    assert results == [expected for *_, expected in CASES] * 2


def test_rewards_in_spawned_process_pool() -> None:
    combined = combine_rewards({"boxed_math": 1.0, "answer_format": 0.5})
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        results = list(pool.map(_run_case, CASES))
        futures = [
            pool.submit(combined, r"\boxed{0.5}", r"\frac{1}{2}"),
            pool.submit(combined, r"\boxed{0.4}", r"\frac{1}{2}"),
            pool.submit(REWARDS["test_length"], "ab", "cd"),
        ]
        combined_results = [future.result() for future in futures]
    assert results == [expected for *_, expected in CASES]
    assert combined_results == [1.5, 0.5, 1.0]


# --- the config's reward keys ------------------------------------------------------------------


def custom_reward(completion: str, reference: str, custom: dict) -> float:
    return float(custom["scale"]) * len(completion)


def kwargs_reward(completion: str, reference: str, **kwargs: object) -> float:
    return float("custom" in kwargs)


def test_custom_table_reaches_the_functions_that_take_it() -> None:
    combined = combine_rewards(
        {f"{__name__}:custom_reward": 2.0, f"{__name__}:kwargs_reward": 1.0, "gsm8k": 1.0},
        custom={"scale": 0.5},
    )
    assert combined.values("abcd", "#### 1") == {
        f"{__name__}:custom_reward": 2.0,
        f"{__name__}:kwargs_reward": 1.0,
        "gsm8k": 0.0,
    }
    assert combined("abcd", "#### 1") == 5.0
    assert pickle.loads(pickle.dumps(combined))("ab", "#### 1") == 3.0
    with pytest.raises(KeyError, match="scale"):  # taken, but the table lacks the key
        combine_rewards(f"{__name__}:custom_reward")("ab", "x")


def test_scorer_reads_the_reward_keys_of_the_config() -> None:
    from nebula_rl.config import config_from_dict
    from nebula_rl.rewards import scorer

    def cfg(**policy: object) -> object:
        return config_from_dict(
            {
                "train": {
                    "train_policy": {
                        "type": "grpo",
                        "reward_function": {"answer_format": 2.0},
                        "filter_reward_metric": ["answer_format", f"{__name__}:length_reward"],
                        "overlong_reward": {"enable_overlong_penalty": True, "buffer_length": 4},
                        **policy,
                    }
                },
                "rollout": {"backend": "torch", "max_response_length": 8},
                "validation": {"reward_function": "gsm8k"},
            }
        )

    text = r"So \boxed{18}"
    scored = scorer(cfg()).score(text, 6, "#### 18")  # 6 tokens: 2 into the overlong buffer
    assert scored.terms == {"answer_format": 1.0, f"{__name__}:length_reward": 0.0}
    assert scored.reward == pytest.approx(2.0 - 0.5)  # the filter-only metric adds nothing
    validation = scorer(cfg(), validation=True).score(text, 6, "#### 18")
    assert (validation.reward, validation.terms) == (1.0, {"gsm8k": 1.0})  # no length penalty
    bypass = scorer(cfg(bypass_reward=True, dynamic_sampling=False)).score(text, 6, "#### 18")
    assert (bypass.reward, bypass.terms) == (0.0, {})


GROUP_CALLS: list[int] = []
"""The group size of each `rank_reward` call (this process's)."""


def rank_reward(completions: list[str], reference: str) -> list[float]:
    """A group reward: each completion's rank by length within its group, in [0, 1]."""
    GROUP_CALLS.append(len(completions))
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    ranks = [0.0] * len(completions)
    for rank, i in enumerate(order):
        ranks[i] = rank / max(len(completions) - 1, 1)
    return ranks


def one_number_reward(completions: list[str], reference: str) -> float:
    return 1.0


def test_group_reward_calculation_calls_user_functions_once_per_group() -> None:
    """With `group_reward_calculation` a user function gets the whole group and answers for
    each completion; nebula-rl's own rewards are still mapped one completion at a time;
    training and validation both score so, in a reward process too (pickled). A function
    that does not answer with one number per completion is an error naming it; with remote
    rewards the key is refused."""
    from nebula_rl.config import ConfigError, config_from_dict
    from nebula_rl.rewards import scorer

    def cfg(grouped: bool = True, **policy: object) -> object:
        return config_from_dict(
            {
                "train": {
                    "train_policy": {
                        "type": "grpo",
                        "group_reward_calculation": grouped,
                        "reward_function": {f"{__name__}:rank_reward": 1.0, "answer_format": 2.0},
                        **policy,
                    }
                },
                "rollout": {"backend": "torch"},
                "validation": {"reward_function": f"{__name__}:rank_reward"},
            }
        )

    texts, lengths = ["a", r"so \boxed{1}", "abc"], [1, 5, 2]
    GROUP_CALLS.clear()
    scored = scorer(cfg()).score_group(texts, lengths, "#### 1")
    assert GROUP_CALLS == [3]
    assert [s.terms[f"{__name__}:rank_reward"] for s in scored] == [0.0, 1.0, 0.5]
    assert [s.terms["answer_format"] for s in scored] == [0.0, 1.0, 0.0]
    assert [s.reward for s in scored] == [0.0, 3.0, 0.5]
    validation = scorer(cfg(), validation=True).score_group(texts, lengths, "#### 1")
    assert [s.reward for s in validation] == [0.0, 1.0, 0.5] and GROUP_CALLS == [3, 3]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        remote = pool.submit(scorer(cfg()).score_group, texts, lengths, "#### 1").result()
    assert remote == scored
    with pytest.raises(TypeError):  # (without the key the function gets one text at a time)
        scorer(cfg(grouped=False)).score_group(texts, lengths, "#### 1")
    bad = cfg(reward_function=f"{__name__}:one_number_reward")
    with pytest.raises(ValueError, match=r"one_number_reward' returned float for a group of 3"):
        scorer(bad).score_group(texts, lengths, "#### 1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"group_reward_calculation = true: it calls this"):
        config_from_dict(
            {
                "train": {
                    "train_policy": {
                        "type": "grpo",
                        "group_reward_calculation": True,
                        "use_remote_reward": True,
                        "remote_reward": {"reward_fns": [{"name": "brightness"}]},
                    }
                }
            }
        )
