"""Models named by a Hugging Face Hub id, resolved in a cache laid out as huggingface_hub
lays it out. HF_HUB_OFFLINE is on in every test: nothing here may reach the network."""

import json

import pytest
from hub_support import COMMIT, add_snapshot

from keel.config import load_config
from keel.errors import ConfigError, ModelError
from keel.models import apply_method, load_for_inference, load_model, resolve_model_path
from keel.models.adapters import save_model_dir
from keel.models.hub import download_hub_model, hub_source, is_hub_id
from keel.precision import Precision

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty offline cache: huggingface_hub read HF_HUB_CACHE/OFFLINE at import, so the
    constants are patched as well as the environment."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def cached_model(hub_cache, tiny_model_dir):
    return add_snapshot(hub_cache, REPO, tiny_model_dir)


def test_the_fixture_cache_is_what_huggingface_hub_reads(cached_model, hub_cache):
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO, "config.json", cache_dir=hub_cache)
    assert found == str(cached_model / "config.json")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("meta-llama/Llama-3.2-1B", True),
        ("bundled:smollm2-135m-instruct", False),
        ("/abs/path/model", False),
        ("./rel/model", False),
        ("~/models/x", False),
        ("just-a-name", False),
        ("a/b/c", False),
        ("bad--org/name", False),
    ],
)
def test_is_hub_id(path, expected):
    assert is_hub_id(path) is expected


def test_an_existing_local_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/model")


def test_hub_id_resolves_to_the_cached_snapshot(cached_model, tmp_path):
    path = resolve_model_path(REPO, tmp_path / "keel-cache", log=lambda _: None)
    assert path == cached_model
    assert hub_source(path).repo_id == REPO and hub_source(path).commit == COMMIT


def test_revision_pinned_to_the_commit(cached_model, tmp_path):
    path = resolve_model_path(REPO, tmp_path, log=lambda _: None, revision=COMMIT)
    assert path == cached_model


def test_unknown_revision_names_it(cached_model, tmp_path):
    with pytest.raises(
        ModelError, match=r"\(revision v9\) is not a local folder and is not in the"
    ):
        resolve_model_path(REPO, tmp_path, log=lambda _: None, revision="v9")


def test_missing_id_offline_says_it_is_not_in_the_cache(hub_cache, tmp_path):
    with pytest.raises(ModelError) as caught:
        resolve_model_path("tiny-org/absent", tmp_path, log=lambda _: None)
    message = str(caught.value)
    assert message.startswith("model tiny-org/absent (revision main) is not a local folder")
    assert f"is not in the Hugging Face cache at {hub_cache}" in message
    assert "HF_HUB_OFFLINE=1" in message and "`hf download tiny-org/absent`" in message
    assert "point model.path at a local folder" in message


def test_a_missing_local_path_keeps_its_message(tmp_path):
    with pytest.raises(ModelError, match=r"model path '\./nope' does not exist"):
        resolve_model_path("./nope", tmp_path)


def _raising(exc):
    def fake(*args, **kwargs):
        raise exc

    return fake


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("GatedRepoError", "is a gated model: accept its conditions"),
        ("RepositoryNotFoundError", "nor a model on the Hugging Face Hub"),
        ("RevisionNotFoundError", "has no revision 'main' on the Hugging Face Hub"),
        ("LocalEntryNotFoundError", "could not be downloaded from the Hugging Face Hub"),
    ],
)
def test_hub_errors_are_named(error, expected, hub_cache, monkeypatch):
    """Online failures (huggingface_hub's own exception types) become ModelErrors (exit 2)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    cls = getattr(errors, error)
    if issubclass(cls, errors.HfHubHTTPError):  # these carry the Hub's HTTP response
        import httpx2

        url = f"https://huggingface.co/api/models/{REPO}"
        response = httpx2.Response(404, request=httpx2.Request("GET", url))
        exc = cls("the hub said no", response=response)
    else:
        exc = cls("the hub said no")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(exc))
    with pytest.raises(ModelError, match=expected):
        download_hub_model(REPO, log=lambda _: None)


def test_config_accepts_a_hub_id(tmp_path, data_file):
    cfg = _config(tmp_path, data_file, REPO)
    assert load_config(cfg).model.revision == "main"


def test_config_refuses_a_revision_without_a_hub_id(tmp_path, data_file, tiny_model_dir):
    cfg = _config(tmp_path, data_file, str(tiny_model_dir))
    with pytest.raises(ConfigError, match="model.revision = 'v1' applies to Hugging Face Hub"):
        load_config(cfg, ["model.revision=v1"])


def _config(tmp_path, data_file, model_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        json.dumps(
            {
                "model": {"path": model_path},
                "data": {"datasets": [str(data_file)]},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    return path


def test_adapter_names_the_hub_id_and_commit(cached_model, tmp_path, tiny_tokenizer):
    """Not the snapshot's absolute path, which differs on every machine."""
    from keel.config.schema import MethodConfig

    model = apply_method(load_model(cached_model, dtype=None), MethodConfig(type="lora"))
    out = tmp_path / "adapter"
    save_model_dir(model, tiny_tokenizer, out)
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == REPO and saved["revision"] == COMMIT
    card = (out / "README.md").read_text()
    assert f"base_model: {REPO}" in card and str(cached_model) not in card
    # ... and it loads again through that id, from the cache
    loaded, _ = load_for_inference(str(out), None, cache_dir=tmp_path, log=lambda _: None)
    assert hub_source(loaded.peft_config["default"].base_model_name_or_path) is None


def test_run_identity_records_the_commit(cached_model, tmp_path, data_file, tiny_model_dir):
    from keel.checkpoint.identity import identity_differences, run_identity

    hub = run_identity(
        load_config(_config(tmp_path, data_file, REPO)),
        cached_model,
        Precision("fp32", "test"),
        "d",
    )
    assert hub.model_revision == COMMIT
    local_cfg = load_config(_config(tmp_path, data_file, str(tiny_model_dir)))
    local = run_identity(local_cfg, tiny_model_dir, Precision("fp32", "test"), "d")
    assert local.model_revision == ""
    older = {k: v for k, v in local.to_meta()["run"].items() if k != "model_revision"}
    assert identity_differences(older, local) == []  # checkpoints from before still resume


def test_plan_reads_the_architecture_by_hub_id(cached_model, tmp_path, data_file):
    from keel.plan.architecture import read_architecture

    cfg = load_config(_config(tmp_path, data_file, REPO))
    assert read_architecture(cfg, log=lambda _: None).model_type == "llama"


def test_training_fetches_once_per_node(cached_model, tmp_path, data_file, tiny_model_dir):
    from keel.distributed.process_group import DistContext
    from keel.train.hub_fetch import fetch_hub_model

    cfg = load_config(_config(tmp_path, data_file, REPO))
    assert fetch_hub_model(cfg, DistContext(), lambda _: None) == cached_model
    local = load_config(_config(tmp_path, data_file, str(tiny_model_dir)))
    assert fetch_hub_model(local, DistContext(), lambda _: None) is None
