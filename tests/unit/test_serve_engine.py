"""keel serve's engine: a batched answer equals the same answer alone (greedy), per adapter too."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from serve_support import random_lora, varied_tiny_model
from transformers import DynamicCache

from keel.errors import ModelError
from keel.infer.serve.adapters import AdapterSet
from keel.infer.serve.engine import Engine
from keel.infer.serve.kv import PaddedBatch
from keel.infer.serve.sampling import SamplingParams
from keel.infer.serve.scheduler import Delta, Done, Failed, Job
from keel.infer.serve.text import TextTracker

PROMPTS = [
    "Who are you?",
    "The quick brown fox jumps over the lazy dog. Translate to French: hello world.",
    "0 1 2",
    "Give three tips for staying healthy. Eat well, sleep enough",
    "system user assistant instruction input output response question answer system user",
]
BASE = "tiny"


@dataclass
class Outcome:
    pieces: list[str] = field(default_factory=list)
    done: Done | None = None
    failed: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def make_job(tokenizer, prompt: str, outcome: Outcome, *, model=BASE, **params) -> Job:
    def sink(event):
        if isinstance(event, Delta):
            outcome.pieces.append(event.text)
        elif isinstance(event, Done):
            outcome.done = event
        else:
            assert isinstance(event, Failed)
            outcome.failed = event.message

    params = {"temperature": 0.0, **params}
    return Job(
        prompt_ids=tokenizer.encode(prompt),
        params=SamplingParams(**params),
        model=model,
        sink=sink,
    )


def run(engine: Engine, jobs: list[Job], *, join_every: int = 1) -> None:
    """Submit one job every `join_every` scheduler steps, so later jobs join a batch that is
    already decoding (0: all at once, prefilled together), then step until all finished."""
    pending = list(jobs)
    steps = 0
    while True:
        while pending and (join_every == 0 or steps % join_every == 0):
            engine.submit(pending.pop(0))
            if join_every:
                break
        busy = engine.step()
        steps += 1
        if not busy and not pending:
            return


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return varied_tiny_model(len(tiny_tokenizer))


@pytest.fixture
def engine(model, tiny_tokenizer):
    engine = Engine(AdapterSet(model, BASE), tiny_tokenizer, max_batch_size=8)
    engine.eos_ids = set()  # run every reply to max_tokens, so lengths are known
    return engine


def alone(engine, tokenizer, prompt, **kw) -> Outcome:
    outcome = Outcome()
    run(engine, [make_job(tokenizer, prompt, outcome, **kw)])
    return outcome


def test_batched_greedy_equals_alone_and_hf_generate(engine, model, tiny_tokenizer):
    lengths = [12 + 7 * i for i in range(len(PROMPTS))]
    singles = [alone(engine, tiny_tokenizer, p, max_tokens=n) for p, n in zip(PROMPTS, lengths)]
    for join_every in (0, 1, 5):  # prefilled together, then joining at each or every 5th step
        outcomes = [Outcome() for _ in PROMPTS]
        jobs = [
            make_job(tiny_tokenizer, p, o, max_tokens=n)
            for p, o, n in zip(PROMPTS, outcomes, lengths)
        ]
        run(engine, jobs, join_every=join_every)
        assert [o.text for o in outcomes] == [s.text for s in singles]
        assert [o.done.tokens for o in outcomes] == lengths
    assert engine.stats.peak_batch == len(PROMPTS)
    for prompt, single, n in zip(PROMPTS, singles, lengths):
        ids = torch.tensor([tiny_tokenizer.encode(prompt)])  # [1, P]
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        expected = tiny_tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert single.text == expected


def test_mixed_adapters_share_a_batch(model, tiny_tokenizer, tmp_path):
    import copy

    adapters = AdapterSet(copy.deepcopy(model), BASE)
    adapters.load("a", str(random_lora(model, tmp_path / "a", seed=1)))
    adapters.load("b", str(random_lora(model, tmp_path / "b", seed=2, targets=("o_proj",))))
    engine = Engine(adapters, tiny_tokenizer, max_batch_size=8)
    engine.eos_ids = set()
    plan = [(p, name) for p in PROMPTS[:3] for name in (BASE, "a", "b")]
    singles = [alone(engine, tiny_tokenizer, p, model=name, max_tokens=16) for p, name in plan]
    for join_every in (0, 2):
        outcomes = [Outcome() for _ in plan]
        jobs = [
            make_job(tiny_tokenizer, p, o, model=name, max_tokens=16)
            for (p, name), o in zip(plan, outcomes)
        ]
        run(engine, jobs, join_every=join_every)
        assert [o.text for o in outcomes] == [s.text for s in singles]
    for i in range(0, len(plan), 3):  # each adapter answers differently from the base
        base, a, b = (s.text for s in singles[i : i + 3])
        assert len({base, a, b}) == 3
    plain = Engine(AdapterSet(model, BASE), tiny_tokenizer, max_batch_size=8)
    plain.eos_ids = set()
    # "__base__" rows of the PEFT model answer as the plain model does
    assert singles[0].text == alone(plain, tiny_tokenizer, PROMPTS[0], max_tokens=16).text


def test_unload_fails_its_running_requests(model, tiny_tokenizer, tmp_path):
    import copy

    adapters = AdapterSet(copy.deepcopy(model), BASE)
    adapters.load("a", str(random_lora(model, tmp_path / "a", seed=1)))
    engine = Engine(adapters, tiny_tokenizer, max_batch_size=8)
    on_a, on_base = Outcome(), Outcome()
    engine.submit(make_job(tiny_tokenizer, PROMPTS[0], on_a, model="a", max_tokens=50))
    engine.submit(make_job(tiny_tokenizer, PROMPTS[1], on_base, max_tokens=50))
    engine.step()
    future = engine.unload_adapter("a")
    engine.step()
    future.result(timeout=1)
    assert "unloaded" in on_a.failed and adapters.names() == [BASE]
    while engine.step():
        pass
    assert on_base.done is not None and on_base.failed is None
    with pytest.raises(ModelError, match="no adapter named 'a'"):
        adapters.unload("a")


def test_cancelled_job_leaves_the_batch(engine, tiny_tokenizer):
    kept, dropped = Outcome(), Outcome()
    expected = alone(engine, tiny_tokenizer, PROMPTS[3], max_tokens=30)
    dropped_job = make_job(tiny_tokenizer, PROMPTS[1], dropped, max_tokens=30)
    engine.submit(make_job(tiny_tokenizer, PROMPTS[3], kept, max_tokens=30))
    engine.submit(dropped_job)
    for _ in range(5):
        engine.step()
    assert engine.stats.running == 2
    engine.cancel(dropped_job)
    engine.step()
    assert engine.stats.running == 1 and engine._batch.size == 1
    while engine.step():
        pass
    assert kept.text == expected.text and dropped.done is None


def test_queue_waits_for_room(model, tiny_tokenizer):
    engine = Engine(AdapterSet(model, BASE), tiny_tokenizer, max_batch_size=2)
    engine.eos_ids = set()
    outcomes = [Outcome() for _ in range(4)]
    for prompt, outcome in zip(PROMPTS, outcomes):
        engine.submit(make_job(tiny_tokenizer, prompt, outcome, max_tokens=6))
    engine.step()
    assert (engine.stats.running, engine.stats.waiting) == (2, 2)
    while engine.step():
        assert engine.stats.running <= 2
    assert all(o.done.tokens == 6 for o in outcomes)


def test_end_of_turn_token_stops_with_reason_stop(engine, tiny_tokenizer):
    engine.eos_ids = set(range(len(tiny_tokenizer)))  # whatever comes first ends the turn
    outcome = alone(engine, tiny_tokenizer, PROMPTS[0], max_tokens=10)
    assert (outcome.done.reason, outcome.done.tokens, outcome.text) == ("stop", 1, "")


def test_sampling_is_seeded_and_top_p_keeps_the_head(engine, tiny_tokenizer):
    def sample(**kw):
        return alone(engine, tiny_tokenizer, PROMPTS[0], max_tokens=20, temperature=1.0, **kw)

    assert sample(seed=7).text == sample(seed=7).text
    assert sample(seed=7).text != sample(seed=8).text
    greedy = alone(engine, tiny_tokenizer, PROMPTS[0], max_tokens=20).text
    assert sample(seed=3, top_p=1e-6).text == greedy  # only the top token survives


def test_n_choices_share_one_prefill(engine, tiny_tokenizer):
    seen: dict[int, list[str]] = {0: [], 1: [], 2: []}
    done = []
    job = make_job(tiny_tokenizer, PROMPTS[2], Outcome(), max_tokens=8, temperature=1.0, seed=5)
    job.n = 3

    def sink(event):
        if isinstance(event, Delta):
            seen[event.index].append(event.text)
        elif isinstance(event, Done):
            done.append(event.index)

    job.sink = sink
    run(engine, [job])
    assert sorted(done) == [0, 1, 2]
    texts = ["".join(v) for v in seen.values()]
    assert len(set(texts)) == 3  # choice i samples with seed + i


def test_stop_string_is_never_streamed(tiny_tokenizer):
    tracker = TextTracker(tiny_tokenizer, stop=("lazy dog",))
    pieces = []
    for token in tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello"):
        piece, hit = tracker.add(token)
        pieces.append(piece)
        if hit:
            break
    assert hit and "".join(pieces) == "The quick brown fox jumps over the "
    tracker = TextTracker(tiny_tokenizer, stop=("dog!",))
    text = "".join(tracker.add(t)[0] for t in tiny_tokenizer.encode("the lazy dog."))
    assert text + tracker.flush() == "the lazy dog."  # a partial stop is released at the end


def test_padded_batch_trims_columns_no_row_needs(model, tiny_tokenizer):
    batch = PaddedBatch()
    for length in (3, 7):
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.arange(10, 10 + length)[None], past_key_values=cache)
        batch.add(cache, torch.ones(1, length, dtype=torch.bool), [0])
    assert batch.width == 7 and batch.valid.sum(dim=1).tolist() == [3, 7]
    short = batch.cache.layers[0].keys[0, :, 4:].clone()  # row 0's real columns
    batch.keep([0])
    assert batch.width == 3 and bool(batch.valid.all())
    assert torch.equal(batch.cache.layers[0].keys[0], short)


def test_a_lora_output_dir_is_served_as_its_base_plus_that_adapter(tiny_tokenizer, tmp_path):
    from serve_support import write_model_dir
    from transformers import AutoModelForCausalLM

    from keel.infer.serve.server import ServeOptions, build_state

    model_dir = write_model_dir(
        varied_tiny_model(len(tiny_tokenizer)), tiny_tokenizer, tmp_path / "b"
    )
    trained = random_lora(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "run", seed=3)
    state = build_state(ServeOptions(model=str(trained)), log=lambda message: None)
    engine = state.engine
    assert engine.adapters.names() == [str(model_dir), str(trained)]
    assert state.default_model == str(trained)
    engine.eos_ids = set()
    answers = [
        alone(engine, tiny_tokenizer, PROMPTS[0], model=name, max_tokens=12).text
        for name in engine.adapters.names()
    ]
    assert answers[0] != answers[1]
