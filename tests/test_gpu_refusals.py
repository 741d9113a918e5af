"""The card's command where it cannot run, refused before Ray or any actor starts, naming the
flag: GPUs with no --config (the default is the CPU pair), and a target its tensor-parallel
size cannot split (query or KV heads, MLP columns, vocabulary) or that runs on llama.cpp.
No Ray here: the refusals come first.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from ssd.app import launcher
from ssd.cluster.devices import Placement
from ssd.cluster.placing import refuse_unsplittable, target_shape
from ssd.config import Config, ConfigError, ModelConfig, TinyModelConfig
from ssd.models.tp import TP_DIVIDED
from tests.conftest import ROOT

CARD = ["--target-gpus", "0-3", "--draft-gpu", "4"]


class Started(Exception):
    """start_cluster was reached: nothing refused the command (args: its arguments)."""


@pytest.fixture
def five_gpus(monkeypatch):
    monkeypatch.setattr(launcher, "available_gpus", lambda: 5)

    def start(*args, **kwargs):
        raise Started(*args)

    monkeypatch.setattr("ssd.cluster.replicas.start_cluster", start)


def test_the_card_s_command_without_config_is_refused_naming_config_and_the_gpu_pairs(five_gpus):
    with pytest.raises(SystemExit) as refused:
        launcher.main(CARD)
    message = str(refused.value.code)
    assert message.startswith("error: --config:") and "configs/qwen3-32b-gpu.yaml" in message
    assert "configs/llama3.1-70b-gpu.yaml" in message and "CPU pair" in message


def test_with_a_gpu_config_or_on_cpu_the_command_goes_on(five_gpus):
    """Power: the refusal is the missing --config's, not the GPU layout's."""
    with pytest.raises(Started):
        launcher.main([*CARD, "--config", str(ROOT / "configs" / "qwen3-32b-gpu.yaml")])
    with pytest.raises(Started):
        launcher.main(["--cpu"])


def test_the_launcher_starts_a_ray_of_its_own_unless_told_to_join_one(five_gpus, monkeypatch):
    """No address: "local", never a Ray another run left on the host (ray.init's default may join it)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for argv, address in ((["--cpu"], "local"), (["--cpu", "--address", "auto"], "auto")):
        with pytest.raises(Started) as started:
            launcher.main(argv)
        assert started.value.args[2] == address
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    with pytest.raises(Started) as started:
        launcher.main(["--cpu"])
    assert started.value.args[2] == "10.0.0.7:6379"


def _qwen_dir(tmp_path, **shape) -> str:
    """A checkpoint directory holding only config.json (Qwen2.5-Coder-1.5B's shape unless given)."""
    config = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936} | shape
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _placed(ranks: int) -> Placement:
    return Placement("cuda", tuple(range(ranks)), (ranks,))


def _config(name: str, **model) -> Config:
    return Config(target=ModelConfig(name=name, **model))


def test_the_cpu_pair_s_target_is_refused_at_four_ranks_naming_its_kv_heads(tmp_path):
    config = _config(_qwen_dir(tmp_path), backend="torch")
    with pytest.raises(ConfigError) as refused:
        refuse_unsplittable(config, _placed(4), "cuda")
    message = str(refused.value)
    assert message.startswith("--target-gpus: 4 target ranks cannot split") and "num_key_value_heads = 2" in message
    refuse_unsplittable(config, _placed(2), "cuda")  # 12 q and 2 KV heads split in two
    with pytest.raises(ConfigError, match=r"num_attention_heads = 12, num_key_value_heads = 2 not divisible by 8"):
        refuse_unsplittable(config, _placed(8), "cuda")


@pytest.mark.parametrize("name", TP_DIVIDED)
def test_each_divided_dimension_is_checked(tmp_path, name):
    """Power: a dimension left unchecked would let this shape through."""
    base = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000}
    config = _config(_qwen_dir(tmp_path, **(base | {name: base[name] + 2})), backend="torch")
    with pytest.raises(ConfigError, match=rf"\b{name} = {base[name] + 2}\b"):
        refuse_unsplittable(config, _placed(4), "cuda")
    (tmp_path / "config.json").unlink()
    refuse_unsplittable(_config(_qwen_dir(tmp_path, **base), backend="torch"), _placed(4), "cuda")


def test_tiny_targets_and_llamacpp_targets(tmp_path):
    tiny = _config("tiny", tiny=TinyModelConfig(num_attention_heads=4, num_key_value_heads=2))
    assert target_shape(tiny.target)["num_key_value_heads"] == 2
    refuse_unsplittable(tiny, dataclasses.replace(_placed(2), kind="cpu"), "cpu")
    with pytest.raises(ConfigError, match=r"^--target-cores: 4 target ranks cannot split target tiny"):
        refuse_unsplittable(tiny, dataclasses.replace(_placed(4), kind="cpu"), "cpu")
    gguf = _config("tiny", backend="llamacpp")
    with pytest.raises(ConfigError, match=r"^--target-cores: 2 target ranks need a torch target"):
        refuse_unsplittable(gguf, dataclasses.replace(_placed(2), kind="cpu"), "cpu")


def test_the_gpu_configs_split_over_the_card_s_four_ranks_and_not_three(tmp_path):
    """The shipped GPU pairs' targets at their released shapes (config.json fields) go through the
    check: 4 ranks split them, 3 do not (64 heads)."""
    released = {"Qwen/Qwen3-32B": {"num_attention_heads": 64, "num_key_value_heads": 8,
                                   "intermediate_size": 25600, "vocab_size": 151936},
                "meta-llama/Llama-3.1-70B-Instruct": {"num_attention_heads": 64, "num_key_value_heads": 8,
                                                      "intermediate_size": 28672, "vocab_size": 128256}}
    paths = sorted((ROOT / "configs").glob("*-gpu.yaml"))
    assert len(paths) == len(released)
    for i, path in enumerate(paths):
        name = yaml.safe_load(path.read_text())["target"]["name"]
        folder = tmp_path / str(i)
        folder.mkdir()
        config = _config(_qwen_dir(folder, **released[name]), backend="torch")
        refuse_unsplittable(config, _placed(4), "cuda")
        with pytest.raises(ConfigError, match="num_attention_heads = 64"):
            refuse_unsplittable(config, _placed(3), "cuda")
