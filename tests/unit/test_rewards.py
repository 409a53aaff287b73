"""keel.rewards: resolving reward specs, calling them TRL's way, errors, built-ins, reward models."""

import dataclasses
import math
import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from keel.errors import ConfigError
from keel.rewards import (
    RewardError,
    RewardFunction,
    RewardInputs,
    RewardLog,
    RewardLogError,
    TrainerState,
    exact_match,
    format,
    load_rewards,
    score_rewards,
    weighted_rewards,
)

USER_FILE = """
SEEN = []

def correct(prompts, completions, completion_ids, answer, **kwargs):
    SEEN.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                     answer=answer, **kwargs))
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

def only_completions(completions):
    return [float(len(c)) for c in completions]

def unscorable(completions, **kwargs):
    return [None if c == "?" else 0.5 for c in completions]

def broken(completions, **kwargs):
    return [1 / 0 for c in completions]

def too_few(completions, **kwargs):
    return [1.0]

def text_scores(completions, **kwargs):
    return ["high" for c in completions]

def needs_source(completions, source):
    return [0.0 for c in completions]

async def later(completions, **kwargs):
    return [2.0 for c in completions]

def as_number(completions, **kwargs):
    return [float(c) for c in completions]

def logs(completions, log_metric, log_extra, **kwargs):
    log_metric("chars", sum(len(c) for c in completions) / len(completions))
    log_metric("chars", float("nan"))  # left out of the mean
    log_extra("chars", [len(c) for c in completions])
    return [None for c in completions]

def logs_through_kwargs(completions, **kwargs):
    import numpy
    kwargs["log_metric"]("calls", numpy.float32(1.0))
    kwargs["log_extra"]("parsed", [{"n": numpy.int64(len(c)), "ok": c != "?"} for c in completions])
    return [0.0 for c in completions]

def logs_then_raises(completions, log_metric, **kwargs):
    log_metric("before", 1.0)
    if "boom" in completions:
        raise ValueError("boom")
    return [0.0 for c in completions]

def logs_badly(completions, log_metric, log_extra, level, **kwargs):
    kind = level[0]
    if kind == "reserved":
        log_metric("reward", 1.0)
    elif kind == "text":
        log_metric("chars", "many")
    elif kind == "short":
        log_extra("chars", [1])
    elif kind == "object":
        log_extra("chars", [object() for c in completions])
    return [0.0 for c in completions]

def one_at_a_time(completions, **kwargs):
    if len(completions) > 1:
        raise ValueError("one at a time")
    return [0.0 for c in completions]
"""


def _inputs(completions: list, answers: list, step: int = 7) -> RewardInputs:
    """Two prompts, each with len(completions) // 2 samples."""
    g = len(completions) // 2
    return RewardInputs(
        prompts=["What is 2+2?"] * g + ["What is 1+2?"] * g,
        completions=completions,
        completion_ids=[[i, i + 1] for i in range(len(completions))],
        columns={"answer": answers, "level": ["easy"] * len(completions)},
        where=[
            f"prompt {i // g} (row {10 + i // g}), sample {i % g}" for i in range(len(completions))
        ],
        step=step,
    )


@pytest.fixture
def user_file(tmp_path) -> Path:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_rewards.py").write_text(USER_FILE)
    return tmp_path


def _load(base: Path, *names: str) -> list[RewardFunction]:
    return load_rewards([f"rewards/my_rewards.py:{name}" for name in names], base)


def test_a_user_file_is_called_once_with_trls_arguments(user_file):
    (correct,) = _load(user_file, "correct")
    assert correct.name == "rewards/my_rewards.py:correct"
    inputs = _inputs(["4", " 5", "3", "3 "], ["4", "4", 3, 3])
    scores = score_rewards([correct], inputs)
    assert scores.dtype == torch.float32 and scores.tolist() == [[1.0], [0.0], [1.0], [1.0]]
    (seen,) = correct.call.__globals__["SEEN"]  # one call for the whole batch
    assert seen["prompts"] == inputs.prompts and seen["completions"] == inputs.completions
    assert seen["completion_ids"] == inputs.completion_ids
    assert seen["answer"] == ["4", "4", 3, 3] and seen["level"] == ["easy"] * 4
    assert seen["trainer_state"].global_step == 7


def test_trainer_state_says_where_the_run_is_under_transformers_names(user_file):
    """Reward files shape rewards over training with trainer_state (global_step/max_steps)
    or act on one process (is_world_process_zero), as TRL hands them transformers'
    TrainerState; the step is the scoring's."""
    from transformers import TrainerState as Theirs

    (correct,) = _load(user_file, "correct")
    inputs = _inputs(["4", "5"], ["4", "4"], step=3)
    inputs.state = TrainerState(global_step=0, max_steps=10, epoch=0.25, num_train_epochs=2.0,
                                is_world_process_zero=False)  # fmt: skip
    score_rewards([correct], inputs)
    (seen,) = correct.call.__globals__["SEEN"]
    state = seen["trainer_state"]
    assert (state.global_step, state.max_steps, state.epoch) == (3, 10, 0.25)
    assert state.num_train_epochs == 2.0 and not state.is_world_process_zero
    assert state.is_local_process_zero and state.logging_steps == 1
    theirs = {f.name for f in dataclasses.fields(Theirs)}
    assert {f.name for f in dataclasses.fields(state)} <= theirs


def test_a_function_without_kwargs_gets_only_what_it_names(user_file):
    functions = _load(user_file, "only_completions", "needs_source")
    assert score_rewards(functions[:1], _inputs(["ab", "c"], [1, 2])).tolist() == [[2.0], [1.0]]
    with pytest.raises(RewardError, match="needs argument.* source, which no dataset column"):
        score_rewards(functions[1:], _inputs(["ab", "c"], [1, 2]))


def test_none_is_nan_and_functions_are_columns(user_file):
    functions = _load(user_file, "unscorable", "only_completions")
    scores = score_rewards(functions, _inputs(["?", "ok"], [1, 2]))
    assert scores.shape == (2, 2) and math.isnan(scores[0, 0]) and scores[1].tolist() == [0.5, 2.0]


def test_an_async_function_is_awaited(user_file):
    (later,) = _load(user_file, "later")
    assert score_rewards([later], _inputs(["a", "b"], [1, 2])).tolist() == [[2.0], [2.0]]


def test_a_raising_function_names_itself_the_sample_and_the_text(user_file):
    (broken,) = _load(user_file, "broken")
    with pytest.raises(RewardError) as caught:
        score_rewards([broken], _inputs(["the first text", "x"], [1, 2]))
    message = str(caught.value)
    assert "rewards/my_rewards.py:broken raised ZeroDivisionError" in message
    assert "my_rewards.py:" in message.split("ZeroDivisionError")[1]  # the line it raised at
    assert "prompt 0 (row 10), sample 0: 'the first text'" in message
    assert caught.value.exit_code == 2


def test_a_raising_function_names_the_completion_it_raises_on(user_file):
    """The batch call raises; calling the function on each completion alone finds the one
    that makes it raise (here the third), and the message names that sample, not the first."""
    (as_number,) = _load(user_file, "as_number")
    with pytest.raises(RewardError) as caught:
        score_rewards([as_number], _inputs(["1", "2", "three", "4"], [1, 2, 3, 4]))
    message = str(caught.value)
    assert "as_number raised ValueError" in message
    assert "on prompt 1 (row 11), sample 0: 'three' (called on it alone" in message
    assert "'1'" not in message


def test_a_function_that_raises_only_on_the_batch_names_the_first_sample(user_file):
    (one_at_a_time,) = _load(user_file, "one_at_a_time")
    with pytest.raises(RewardError) as caught:
        score_rewards([one_at_a_time], _three())
    message = str(caught.value)
    assert "one_at_a_time raised ValueError: one at a time" in message
    assert "scoring 3 completions in one call (none of them raises alone)" in message
    assert "the first is prompt 0 (row 10), sample 0: 'a'" in message


def _three() -> RewardInputs:
    """Three completions of one prompt."""
    return RewardInputs(
        prompts=["p"] * 3,
        completions=["a", "b", "c"],
        completion_ids=[[1]] * 3,
        columns={},
        where=[f"prompt 0 (row 10), sample {i}" for i in range(3)],
        step=0,
    )


def test_wrong_length_and_non_numbers_are_refused(user_file):
    too_few, text_scores = _load(user_file, "too_few", "text_scores")
    with pytest.raises(RewardError, match="returned 1 values for 4 completions"):
        score_rewards([too_few], _inputs(["a", "b", "c", "d"], [1] * 4))
    with pytest.raises(RewardError, match=r"returned 'high' \(str\) for prompt 0 \(row 10\)"):
        score_rewards([text_scores], _inputs(["a", "b"], [1, 2]))
    infinite = RewardFunction(name="inf", call=lambda completions, **kw: [math.inf] * 2)
    with pytest.raises(RewardError, match="finite"):
        score_rewards([infinite], _inputs(["a", "b"], [1, 2]))
    not_a_list = RewardFunction(name="one", call=lambda completions, **kw: 1.0)
    with pytest.raises(RewardError, match="returned float, not a list"):
        score_rewards([not_a_list], _inputs(["a", "b"], [1, 2]))


def test_each_call_runs_inside_the_watch(user_file):
    phases = []

    @contextmanager
    def watch(name):
        phases.append(f"{name}: begin")
        yield
        phases.append(f"{name}: end")

    functions = _load(user_file, "unscorable") + load_rewards(["keel.rewards:format"], user_file)
    score_rewards(functions, _inputs(["a", "b"], [1, 2]), watch=watch)
    assert phases == [
        "reward rewards/my_rewards.py:unscorable: begin",
        "reward rewards/my_rewards.py:unscorable: end",
        "reward keel.rewards:format: begin",
        "reward keel.rewards:format: end",
    ]


def test_weighted_rewards_follow_trls_nan_rule():
    nan = float("nan")
    scores = torch.tensor([[1.0, 2.0], [nan, 2.0], [nan, nan]])
    total = weighted_rewards(scores, [1.0, 0.5])
    assert total[:2].tolist() == [2.0, 1.0] and math.isnan(total[2])
    assert weighted_rewards(scores[:1]).tolist() == [3.0]


# --- specs ------------------------------------------------------------------------------------


def test_module_specs_resolve(tmp_path):
    functions = load_rewards(["keel.rewards:format", "keel.rewards:exact_match"], tmp_path)
    assert [f.call for f in functions] == [format, exact_match]


def test_every_bad_spec_is_reported_at_once_with_its_fix(user_file, tiny_model_dir):
    (user_file / "rewards" / "crashes.py").write_text("import not_a_module_anywhere\n")
    specs = [
        "rewards/missing.py:f",
        "rewards/my_rewards.py:corect",
        "rewards/crashes.py:f",
        "no_such_package.sub:f",
        "keel.rewards:nothing",
        "rewards/my_rewards.py",
        "no/such/folder",
        str(tiny_model_dir),
        "C:\\models\\rm",
    ]
    with pytest.raises(ConfigError) as caught:
        load_rewards(specs, user_file)
    problems = caught.value.problems
    assert len(problems) == len(specs)
    expected = [
        "grpo.rewards.0 = 'rewards/missing.py:f': no file .*relative to the config's folder",
        "grpo.rewards.1 = .*has no function 'corect'; did you mean 'correct'",
        "grpo.rewards.2 = .*importing .*crashes.py raised ModuleNotFoundError",
        "grpo.rewards.3 = .*no module named 'no_such_package'; install it, or point at a file",
        "grpo.rewards.4 = .*has no function 'nothing'.*exact_match",
        "grpo.rewards.5 = .*name the function in the file: rewards/my_rewards.py:<function>",
        "grpo.rewards.6 = .*is not a folder.*file.py:function or package.module:function",
        "grpo.rewards.7 = .*LlamaForCausalLM, not a reward model.*train.stage: rm",
        r"grpo.rewards.8 = .*C:\\models\\rm is not a folder",
    ]
    for problem, pattern in zip(problems, expected, strict=True):
        assert re.search(pattern, problem), problem


def test_an_absolute_file_path_works(user_file):
    path = user_file / "rewards" / "my_rewards.py"
    (function,) = load_rewards([f"{path}:only_completions"], Path("/"))
    assert function.call(completions=["abc"]) == [3.0]


# --- built-ins ----------------------------------------------------------------------------------


def test_format_builtin():
    completions = [
        "<think>2 and 2</think>\n<answer>4</answer>",
        "  <answer>4</answer>\n",
        "<answer>4</answer><answer>5</answer>",
        "<think>a</think>",
        "4",
        "<answer>4</answer> and more",
        "<think>a</think><think>b</think><answer>4</answer>",
    ]
    assert format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "<answer>x</answer>"}]]
    assert format(chat) == [1.0]


def test_exact_match_builtin():
    completions = ["<think>2+2</think><answer> 4 </answer>", " 4\n", "<answer>5</answer>", "4", "4"]
    assert exact_match(completions, answer=["4", 4, "4", " 4 ", None]) == [1.0, 1.0, 0.0, 1.0, None]
    chat = [[{"role": "assistant", "content": "<answer>7</answer>"}]]
    assert exact_match(chat, answer=[7]) == [1.0]


def test_builtins_through_score_rewards(tmp_path):
    functions = load_rewards(["keel.rewards:format", "keel.rewards:exact_match"], tmp_path)
    inputs = _inputs(["<answer>4</answer>", "4", "<answer>2</answer>", "nope"], ["4", "4", 3, 3])
    assert score_rewards(functions, inputs).tolist() == [[1, 1], [0, 1], [1, 0], [0, 0]]


# --- a reward model's folder --------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _own_scores(folder: Path, texts: list[str]) -> list[float]:
    """The model's own logits[:, 0], one text at a time (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [
            model(**tokenizer(text, return_tensors="pt", add_special_tokens=False))
            .logits[0, 0]
            .item()
            for text in texts
        ]


def test_a_reward_model_scores_prompt_plus_completion(reward_model_dir, tiny_tokenizer, tmp_path):
    (function,) = load_rewards([reward_model_dir.name], reward_model_dir.parent)
    prompts = ["Who are you?", "Who are you?", "Add 2 and 3.", "Add 2 and 3."]
    completions = [" I am Keel.", " A fox.", " 5", " The quick brown fox jumps over the lazy dog."]
    inputs = RewardInputs(
        prompts=prompts,
        completions=completions,
        completion_ids=[[1]] * 4,
        columns={},
        where=["w"] * 4,
        step=0,
    )
    scores = score_rewards([function], inputs)[:, 0]
    expected = _own_scores(reward_model_dir, [p + c for p, c in zip(prompts, completions)])
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert len(set(scores.tolist())) == 4  # padding did not make them read the same token

    # conversational prompts: the chat template over prompt + the assistant's reply
    chat_prompts = [[{"role": "user", "content": p}] for p in prompts]
    chat_completions = [[{"role": "assistant", "content": c}] for c in completions]
    inputs.prompts, inputs.completions = chat_prompts, chat_completions
    texts = [
        tiny_tokenizer.apply_chat_template(p + c, tokenize=False)
        for p, c in zip(chat_prompts, chat_completions)
    ]
    torch.testing.assert_close(
        score_rewards([function], inputs)[:, 0],
        torch.tensor(_own_scores(reward_model_dir, texts)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_metric_names_are_the_functions_names_unless_two_share_one():
    from keel.rewards.loading import short_names

    specs = ["examples/rewards/sums.py:correct", "keel.rewards:format", "outputs/rm/"]
    assert short_names(specs) == ["correct", "format", "rm"]
    assert short_names(["a.py:f", "b.py:f", "c.py:g"]) == ["a.py:f", "b.py:f", "g"]


# ---- what reward functions log (TRL's log_metric and log_extra) ---------------------


def test_logged_metrics_and_columns_are_collected_per_scoring(user_file):
    functions = _load(user_file, "logs", "logs_through_kwargs")
    log = RewardLog(4, reserved=frozenset({"reward"}))
    scores = score_rewards(functions, _inputs(["ab", "c", "?", "dddd"], [1, 2, 3, 4]), log=log)
    assert torch.isnan(scores[:, 0]).all() and scores[:, 1].tolist() == [0.0] * 4
    assert log.metrics == {"chars": (2.0, 1), "calls": (1.0, 1)}  # (sum, count); NaN left out
    assert log.extras == {
        "chars": [2, 1, 1, 4],
        "parsed": [{"n": 2, "ok": True}, {"n": 1, "ok": True}, {"n": 1, "ok": False},
                   {"n": 4, "ok": True}],
    }  # fmt: skip
    assert type(log.extras["parsed"][0]["n"]) is int  # NumPy scalars become JSON numbers
    # without a log of its own, a scoring still offers the callbacks (a throwaway log)
    assert score_rewards(functions, _inputs(["a", "b"], [1, 2])).shape == (2, 2)


def test_the_search_for_a_raising_sample_logs_nothing(user_file):
    (raising,) = _load(user_file, "logs_then_raises")
    log = RewardLog(2)
    with pytest.raises(RewardError, match="raised ValueError: boom"):
        score_rewards([raising], _inputs(["fine", "boom"], [1, 2]), log=log)
    assert log.metrics == {"before": (1.0, 1)}  # the batch's call, not the per-sample ones


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("reserved", "logged metric 'reward', a name keel's step record already uses"),
        ("text", "logged metric 'chars' = 'many' \\(str\\); log_metric takes one real number"),
        ("short", "logged 1 values in column 'chars' for 2 completions"),
        ("object", "logged <object object at .*> \\(object\\) in column 'chars'"),
    ],
)
def test_what_cannot_be_logged_is_an_error_naming_the_function(user_file, kind, said):
    (bad,) = _load(user_file, "logs_badly")
    inputs = _inputs(["a", "b"], [1, 2])
    inputs.columns["level"] = [kind, kind]
    with pytest.raises(RewardLogError, match="reward function rewards/my_rewards.py:logs_badly "
                       + said) as caught:  # fmt: skip
        score_rewards([bad], inputs, log=RewardLog(2, reserved=frozenset({"reward"})))
    assert caught.value.exit_code == 2
    assert "raised" not in str(caught.value)  # said as it is, not as the function's crash


def test_a_column_logged_twice_in_one_scoring_is_an_error(user_file):
    functions = _load(user_file, "logs", "logs")
    with pytest.raises(RewardLogError, match="column 'chars' was logged twice in one batch"):
        score_rewards(functions, _inputs(["a", "b"], [1, 2]), log=RewardLog(2))
