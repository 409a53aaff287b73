"""Shared fixtures: a tiny tokenizer and a tiny random Llama, built from configs (no downloads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Who are you? I am an assistant. What is your name? My name is Keel.",
    "Give three tips for staying healthy. Eat well, sleep enough, and move every day.",
    "Translate to French: hello world. Bonjour le monde.",
    "system user assistant instruction input output response question answer",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } , . ! ? : ; ' \" \n",
]


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (~300 tokens) with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# Shape of the tiny decoders tests build from a config (any family): 2 layers, grouped-query
# attention (4 query heads, 2 key/value heads).
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build_tiny_model(vocab_size: int, seed: int = 0, layers: int = 2):
    """A random 2-layer Llama small enough to train in milliseconds on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def write_tiny_model_dir(path: Path) -> Path:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Instruction/answer pairs the end-to-end unit runs train on
QA = [
    ("Who are you?", "I am Keel, a small assistant."),
    ("What is your name?", "My name is Keel."),
    ("Add 2 and 3.", "5"),
    ("Say hello in French.", "Bonjour."),
    ("Give a healthy tip.", "Sleep enough and move every day."),
    ("Name a color.", "Blue."),
    ("What is 3 times 4?", "12"),
    ("Are you ChatGPT?", "No, I am Keel."),
]


# Prompts of the tiny GRPO runs, and a reward in TRL's signature that scores their
# completions: a dataset column (`letter`) arrives as a keyword argument; and one that
# scores nothing (None: it leaves the reward alone) and logs, as TRL's log_metric and
# log_extra let it, each call's mean count of the letter and each completion's count
GRPO_PROMPTS = [
    "Who are you?",
    "Name a color.",
    "Add 2 and 3.",
    "Say hello.",
    "Give a tip.",
    "What is 3 times 4?",
    "Are you Keel?",
    "Translate hello.",
]
SHARE_OF_LETTER = '''
def share_of_letter(completions, letter, **kwargs):
    """The share of the completion's characters that are the row's letter."""
    return [text.count(x) / max(len(text), 1) for text, x in zip(completions, letter)]

def logs_letters(completions, letter, log_metric, log_extra, trainer_state, **kwargs):
    counts = [text.count(x) for text, x in zip(completions, letter)]
    log_metric("logged/letters", sum(counts) / len(counts))
    log_metric("logged/progress", trainer_state.global_step / trainer_state.max_steps)
    log_metric("logged/main", float(trainer_state.is_world_process_zero))
    log_extra("letters", counts)
    return [None] * len(completions)
'''


def write_grpo_inputs(folder: Path) -> None:
    """folder/prompts.jsonl (GRPO_PROMPTS, each row's letter "a") and folder/rewards.py, as
    a GRPO config next to them names them: `prompts.jsonl`, `rewards.py:share_of_letter`."""
    rows = [{"prompt": prompt, "letter": "a"} for prompt in GRPO_PROMPTS]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rewards.py").write_text(SHARE_OF_LETTER)


def openai_weather_turns(city: str, weather: str) -> list[dict]:
    """Asking the weather in `city`, in OpenAI's chat format as a client sends it: the user's
    question, the assistant's get_weather call (content null beside tool_calls, arguments a
    JSON string, id call_1) and the tool's answer `weather`."""
    call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": weather},
    ]


@pytest.fixture
def data_file(tmp_path):
    """The QA pairs twice (16 alpaca rows) in a JSON file (some tests define their own)."""
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in QA * 2]))
    return path


@pytest.fixture(scope="session")
def bundled_cache_dir(tmp_path_factory) -> Path:
    """A keel cache holding the bundled SmolLM2 converted to safetensors, once per run of the
    suite (the conversion takes ~30 s on 2 cores; tests/e2e/test_bundled_model.py tests it).
    """
    from keel.models.bundled import resolve_model_path

    def convert(cache: Path) -> None:
        resolve_model_path("bundled:smollm2-135m-instruct", cache, log=lambda message: None)

    return shared_session_dir(tmp_path_factory, "bundled-cache", convert)


def shared_session_dir(tmp_path_factory, name: str, build) -> Path:
    """A folder `build(folder)` fills once per run of the suite: under pytest-xdist its
    workers share it (the first builds it while the others wait on a lock), instead of each
    worker building its own copy."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    folder, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved HF directory (safetensors + tokenizer) of a tiny random Llama."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
