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
from keel.infer.serve.sampling import SamplingParams, draw, sample_token
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


def _random_oft(base, out_dir, *, seed: int):
    """A PEFT OFT adapter for `base` with turned (not identity) rotations."""
    import copy

    from peft import OFTConfig, get_peft_model

    torch.manual_seed(seed)
    config = OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".oft_R." in name:
                param.normal_(0, 0.1)
    peft_model.save_pretrained(out_dir)
    return out_dir


UNBATCHED = {  # adapters PEFT cannot batch per row: how made, what refuses one beside others
    "dora": (
        lambda base, out: random_lora(base, out, seed=3, dora=True),
        "is a DoRA adapter, which PEFT cannot batch",
    ),
    "oft": (
        lambda base, out: _random_oft(base, out, seed=3),
        "says peft_type OFT; only LoRA adapters",
    ),
}


@pytest.mark.parametrize("kind", UNBATCHED)
def test_a_dora_or_oft_adapter_is_served_merged_and_alone(model, tiny_tokenizer, tmp_path, kind):
    """PEFT batches no DoRA or OFT rows with others: loading one beside the base is refused
    with the fix, and such an output folder as --model is served merged, answering as the
    adapter does on its own."""
    import copy

    from peft import PeftModel

    from keel.infer.serve.server import ServeOptions, build_state

    make, refusal = UNBATCHED[kind]
    folder = make(model, tmp_path / "d")
    with pytest.raises(ModelError, match=refusal):
        AdapterSet(copy.deepcopy(model), BASE).load(kind, str(folder))
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    tiny_tokenizer.save_pretrained(base_dir)
    config = (folder / "adapter_config.json").read_text()
    (folder / "adapter_config.json").write_text(config.replace('"base_model_name_or_path": null',
                                                             f'"base_model_name_or_path": "{base_dir}"'))  # fmt: skip
    tiny_tokenizer.save_pretrained(folder)
    logs = []
    state = build_state(ServeOptions(model=str(folder)), log=logs.append)
    assert state.engine.adapters.names() == [str(folder)]
    assert any("served merged into its base" in line for line in logs)
    state.engine.eos_ids = set()
    own = PeftModel.from_pretrained(copy.deepcopy(model), str(folder)).eval()
    for prompt in PROMPTS[:3]:
        served = alone(state.engine, tiny_tokenizer, prompt, model=str(folder), max_tokens=12)
        ids = torch.tensor([tiny_tokenizer.encode(prompt)])  # [1, P]
        out = own.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert served.text == tiny_tokenizer.decode(
            out[0, ids.shape[1] :], skip_special_tokens=True
        )


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
    assert sample(seed=3, top_p=1e-300).text == greedy  # below float32's range, too
    assert sample(seed=2**64 - 1).text  # seed + choice wraps at 64 bits


def test_a_draw_follows_the_weights_and_never_picks_a_zero():
    """draw() samples in proportion to the weights (unnormalised too): 20k draws land within
    4 standard deviations of each share, and a zero weight is never drawn."""
    weights = torch.tensor([0.5, 0.0, 3.0, 1.5, 0.0])  # shares 0.1, 0, 0.6, 0.3, 0
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([draw(weights, generator) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=5).tolist()
    assert counts[1] == counts[4] == 0
    for index, share in ((0, 0.1), (2, 0.6), (3, 0.3)):
        assert abs(counts[index] / 20_000 - share) < 4 * (share * (1 - share) / 20_000) ** 0.5
    again = torch.Generator().manual_seed(0)
    assert [draw(weights, again) for _ in range(5)] == draws[:5].tolist()  # seeded


def test_bad_logits_fail_the_draw_with_the_reason():
    params = SamplingParams(max_tokens=1, temperature=1.0)
    logits = torch.tensor([0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="not finite"):
        sample_token(logits, params, torch.Generator().manual_seed(0))


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
            model(input_ids=torch.arange(10, 10 + length)[None], cache=cache)
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


def test_a_failing_row_ends_only_its_request(engine, tiny_tokenizer):
    # 1e-300 passed validation once: its logits / temperature overflowed to NaN while the
    # row sat in the batch, and the next decode step failed every request in flight.
    expected = alone(engine, tiny_tokenizer, PROMPTS[1], max_tokens=20).text
    for join_every in (0, 1):  # prefilled together, then joining a decoding batch
        good, bad = Outcome(), Outcome()
        jobs = [
            make_job(tiny_tokenizer, PROMPTS[1], good, max_tokens=20),
            make_job(tiny_tokenizer, PROMPTS[0], bad, max_tokens=20, temperature=1e-300),
        ]
        run(engine, jobs, join_every=join_every)
        assert "not finite" in bad.failed and bad.done is None
        assert good.failed is None and good.text == expected
        assert engine.stats.running == 0 and engine._batch.size == 0


def long_prompt(tokenizer, tokens: int) -> str:
    words = PROMPTS[3].split() + PROMPTS[4].split()
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text, i = text + words[i % len(words)] + " ", i + 1
    return text


def test_chunked_prefill_answers_as_one_prefill(model, tiny_tokenizer):
    prompts = [long_prompt(tiny_tokenizer, 150), long_prompt(tiny_tokenizer, 97), PROMPTS[0]]
    texts = {}
    for budget in (512, 16):  # whole prompts in one pass, then 16-token chunks
        engine = Engine(AdapterSet(model, BASE), tiny_tokenizer, max_batch_size=8)
        engine.max_prefill_tokens = budget
        engine.eos_ids = set()
        outcomes = [Outcome() for _ in prompts]
        jobs = [make_job(tiny_tokenizer, p, o, max_tokens=24) for p, o in zip(prompts, outcomes)]
        run(engine, jobs, join_every=0)
        texts[budget] = [o.text for o in outcomes]
        assert all(o.done.tokens == 24 for o in outcomes)
    assert texts[16] == texts[512]


class TokensFed:
    """Counts the tokens each forward pass feeds the model (prefill and decode)."""

    def __init__(self, model):
        self.total = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, _args, kwargs):
        self.total += kwargs["input_ids"].numel()


def test_a_long_prompt_is_prefilled_between_decode_steps(model, tiny_tokenizer):
    budget = 32
    engine = Engine(AdapterSet(model, BASE), tiny_tokenizer, max_batch_size=8)
    engine.max_prefill_tokens = budget
    engine.eos_ids = set()
    short, long = Outcome(), Outcome()
    long_text = long_prompt(tiny_tokenizer, 300)
    solo = alone(engine, tiny_tokenizer, long_text, max_tokens=8).text
    engine.submit(make_job(tiny_tokenizer, PROMPTS[0], Outcome(), max_tokens=30))
    steps_alone = 1
    while engine.step():
        steps_alone += 1
    engine.submit(make_job(tiny_tokenizer, PROMPTS[0], short, max_tokens=30))
    engine.step()  # the short request is decoding
    engine.submit(make_job(tiny_tokenizer, long_text, long, max_tokens=8))
    fed, per_step, steps = TokensFed(model), [], 1
    try:
        while short.done is None:  # steps until the short reply is complete
            before = fed.total
            engine.step()
            per_step.append(fed.total - before)
            steps += 1
        while engine.step():
            pass
    finally:
        fed.handle.remove()
    # The short reply takes one step a token, as it would alone, and no step does more
    # than one budget of prefill besides the decode rows (the old engine fed all 300+
    # prompt tokens in one step).
    assert steps == steps_alone
    assert max(per_step) <= budget + 2 and sum(per_step) > 300
    assert long.text == solo and long.done.tokens == 8


def test_the_cache_goes_by_the_name_transformers_supports(engine, tiny_tokenizer):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = alone(engine, tiny_tokenizer, PROMPTS[0], max_tokens=4)
    assert outcome.failed is None and outcome.done.tokens == 4
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_adapter_caps_on_rank_and_size(model, tmp_path):
    from keel.infer.serve.adapter_files import AdapterCaps, inspect_adapter

    lora = str(random_lora(model, tmp_path / "a", seed=1))  # r = 8
    assert inspect_adapter("a", lora, AdapterCaps(max_rank=8)).pairs
    with pytest.raises(ModelError, match=r"r is 8; .* 1 to 4 .*--max-lora-rank"):
        inspect_adapter("a", lora, AdapterCaps(max_rank=4))
    with pytest.raises(ModelError, match=r"over this server's limit of 100 \(--max-adapter-size"):
        inspect_adapter("a", lora, AdapterCaps(max_bytes=100))


def _whole_module_lora(base, out_dir, *, seed: int):
    """An adapter that also trains the (tied) embeddings in full: PEFT modules_to_save."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj"],
        init_lora_weights=False,
        modules_to_save=["embed_tokens", "lm_head"],
        ensure_weight_tying=True,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def test_an_adapter_that_trains_modules_in_full_is_served_alone(model, tiny_tokenizer, tmp_path):
    """PEFT's mixed batch fails a row of another adapter in a module such an adapter trains
    in full: keel serves it beside the base only, and says so when asked for more."""
    import copy

    live = _whole_module_lora(model, tmp_path / "whole", seed=3)
    adapters = AdapterSet(copy.deepcopy(model), BASE)
    adapters.load("whole", str(tmp_path / "whole"))
    with pytest.raises(ModelError, match=r"the served adapter 'whole' trains embed_tokens"):
        adapters.load("a", str(random_lora(model, tmp_path / "a", seed=1)))
    engine = Engine(adapters, tiny_tokenizer, max_batch_size=8)
    engine.eos_ids = set()
    outcomes = [Outcome(), Outcome()]
    jobs = [
        make_job(tiny_tokenizer, PROMPTS[0], outcomes[0], model=name, max_tokens=12)
        for name in (BASE, "whole")
    ]
    jobs[1] = make_job(tiny_tokenizer, PROMPTS[0], outcomes[1], model="whole", max_tokens=12)
    run(engine, jobs, join_every=0)  # the base and the adapter share a batch
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[0])])  # [1, P]
    out = live.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert outcomes[1].text == tiny_tokenizer.decode(
        out[0, ids.shape[1] :], skip_special_tokens=True
    )
    assert outcomes[0].text != outcomes[1].text
    adapters.unload("whole")
    adapters.load("a", str(tmp_path / "a"))  # alone now, a plain adapter loads
    with pytest.raises(ModelError, match=r"adapter 'whole2' trains embed_tokens.* in full"):
        adapters.load("whole2", str(tmp_path / "whole"))
