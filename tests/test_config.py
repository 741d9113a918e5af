import dataclasses

import pytest
import yaml

from ssd.config import ConfigError, load_config
from tests.conftest import ROOT


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    """Every value the file sets is the value the config holds: none dropped,
    renamed or left at its default."""
    path = ROOT / "configs" / name
    config = load_config(path)
    written, held = leaves(yaml.safe_load(path.read_text())), leaves(dataclasses.asdict(config))
    assert written and written.items() <= held.items()


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"speculation.fanout.budget": 24, ...}: a nested mapping's values by dotted path
    (mappings keyed by numbers, such as backup_policy, are values; lists become tuples)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return out


def test_default_cpu_config_is_the_measured_best():
    config = load_config(ROOT / "configs" / "qwen2.5-coder-cpu.yaml")
    for model in (config.target, config.draft):
        assert (model.dtype, model.quantization) == ("auto", "auto")


def test_unknown_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("draft:\n  tiny:\n    vocab_sise: 8\n")
    with pytest.raises(ConfigError, match=r"draft\.tiny: vocab_sise"):
        load_config(path)


def test_unknown_top_level_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("speculaton: {k: 3}\n")
    with pytest.raises(ConfigError, match="speculaton"):
        load_config(path)


def test_overrides_merge_into_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("speculation: {mode: sd, k: 3}\nsampling: {temperature: 0.5}\n")
    config = load_config(path, {"speculation": {"k": 6}})
    assert config.speculation.k == 6 and config.speculation.mode == "sd"
    assert config.sampling.temperature == 0.5


@pytest.mark.parametrize(
    "text, field",
    [
        ("speculation: {mode: fast}", "speculation.mode"),
        ("speculation: {k: 0}", "speculation.k"),
        ("target: {dtype: fp16}", "model.dtype"),
        ("draft: {quantization: int4}", "model.quantization"),
        ("generation: {max_new_tokens: 0}", "max_new_tokens"),
        ("sampling: {top_p: 0}", "top_p"),
        ("sampling: {coupling: philox}", "sampling.coupling"),
        ("target: {llamacpp_kv: q8_0}", "model.llamacpp_kv"),
        ("target: 3", "target must be a mapping"),
    ],
)
def test_bad_values_name_the_field(tmp_path, text, field):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=field):
        load_config(path)


def test_the_draft_link_is_gloo_only():
    from ssd.config import ClusterConfig

    with pytest.raises(ConfigError, match="cluster.link_backend must be gloo"):
        ClusterConfig(link_backend="nccl")
    with pytest.raises(ConfigError, match="cluster.compute_device"):
        ClusterConfig(compute_device="cuda:1")


def test_the_replicas_step_deadline_and_the_warm_standby_are_checked_by_name():
    from ssd.cluster.devices import plan_placement
    from ssd.cluster.standby import refuse_standby
    from ssd.config import ClusterConfig, Config

    with pytest.raises(ConfigError, match="cluster.step_deadline_s must be > 0"):
        ClusterConfig(step_deadline_s=0)
    with pytest.raises(ConfigError, match="cluster.tp_timeout_s must be > 0"):
        ClusterConfig(tp_timeout_s=0)
    for call_s in (-0.1, 60.0, "fast", True):
        with pytest.raises(ConfigError, match=r"cluster.step_call_s must be >= 0 and below cluster.step_deadline_s \(60\)"):
            ClusterConfig(step_call_s=call_s)
    assert ClusterConfig(step_call_s=0).step_call_s == 0
    with pytest.raises(ConfigError, match="cluster.warm_standby must be true or false"):
        ClusterConfig(warm_standby="yes")
    config = Config(cluster=ClusterConfig(warm_standby=True))
    refuse_standby(config, plan_placement("0", "1", 2, "cpu"))  # one rank: fine
    with pytest.raises(ConfigError, match="cluster.warm_standby takes over from a target of one rank"):
        refuse_standby(config, plan_placement("0-1", "2", 3, "cpu"))


def test_backend_auto_picks_llamacpp_for_a_shipped_gguf_at_auto_precision(monkeypatch, tmp_path):
    """llama.cpp on a CPU for the offline pair (or a .gguf path) at precision auto, when
    installed; an explicit torch precision, a GPU, a model without a GGUF, or no
    llama-cpp-python keep torch; an explicit llamacpp without it is refused by name."""
    from ssd.config import ModelConfig
    from ssd.models import loading
    from ssd.models.offline import TARGET_NAME

    from ssd.models import gguf_choice

    monkeypatch.setattr(gguf_choice, "kernels_can_run", lambda name: False)  # this test: llama.cpp alone
    gguf_choice.choose.cache_clear()
    monkeypatch.setattr(loading, "llamacpp_installed", lambda: True)
    auto = dict(dtype="auto", quantization="auto")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, **auto)) == "llamacpp"
    assert loading.resolve_backend(ModelConfig(name=str(gguf), **auto)) == "llamacpp"
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, **auto), "cuda") == "torch"
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, dtype="fp32", quantization="int8")) == "torch"
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, dtype="auto", quantization=None)) == "torch"
    assert loading.resolve_backend(ModelConfig(name="tiny", **auto)) == "torch"
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, backend="torch", **auto)) == "torch"
    with pytest.raises(ConfigError, match="CPU only"):
        loading.resolve_backend(ModelConfig(name=TARGET_NAME, backend="llamacpp"), "cuda")
    monkeypatch.setattr(loading, "llamacpp_installed", lambda: False)
    assert loading.resolve_backend(ModelConfig(name=TARGET_NAME, **auto)) == "torch"
    with pytest.raises(ConfigError, match="llama-cpp-python"):
        loading.resolve_backend(ModelConfig(name=TARGET_NAME, backend="llamacpp"))


def test_backend_auto_takes_the_gguf_kernels_where_the_probe_times_them_faster(monkeypatch):
    """Both backends run the file: the probe decides (kernels: torch at precision gguf); one alone
    runs it: that one, unprobed; backend torch at precision auto: the kernels wherever they run."""
    from ssd.config import ModelConfig
    from ssd.models import gguf_choice, loading
    from ssd.models.offline import TARGET_NAME

    answer = {"choice": "kernels"}
    probed = []
    monkeypatch.setattr(gguf_choice, "probe", lambda name: probed.append(name) or answer)
    monkeypatch.setattr(gguf_choice, "kernels_can_run", lambda name: True)
    monkeypatch.setattr(loading, "llamacpp_installed", lambda: True)
    auto = ModelConfig(name=TARGET_NAME, dtype="auto", quantization="auto")
    gguf_choice.choose.cache_clear()
    assert loading.resolve_backend(auto) == "torch"
    assert (loading.resolve_precision(auto).dtype, loading.resolve_precision(auto).quantization) == ("fp32", "gguf")
    assert probed == [TARGET_NAME]  # once per process
    answer["choice"] = "llamacpp"
    gguf_choice.choose.cache_clear()
    assert loading.resolve_backend(auto) == "llamacpp"
    torch_auto = dataclasses.replace(auto, backend="torch")
    assert loading.resolve_precision(torch_auto).quantization == "gguf"
    monkeypatch.setattr(loading, "llamacpp_installed", lambda: False)
    gguf_choice.choose.cache_clear()
    assert loading.resolve_backend(auto) == "torch" and loading.resolve_precision(auto).quantization == "gguf"
    assert len(probed) == 2
    gguf_choice.choose.cache_clear()


def test_the_backend_probe_keeps_llamacpp_unless_the_kernels_step_is_as_fast():
    from ssd.models.gguf_choice import decide

    def ms(kernels: float, llama: float) -> dict:
        return {"kernels": {"1": kernels, "8": 2 * kernels}, "llamacpp": {"1": llama, "8": 7 * llama}}

    assert decide(ms(40.0, 39.0)) == "kernels"  # within 5%: its extra rows are far cheaper
    assert decide(ms(42.0, 39.0)) == "llamacpp"


@pytest.mark.parametrize("fields, field", [
    ({"backend": "onnx"}, "model.backend"),
    ({"backend": "llamacpp", "quantization": "int8"}, "model.backend llamacpp"),
    ({"max_model_len": 0}, "model.max_model_len"),
])
def test_bad_backend_values_name_the_field(fields, field):
    from ssd.config import ModelConfig

    with pytest.raises(ConfigError, match=field):
        ModelConfig(**fields)
