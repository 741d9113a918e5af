"""The GPU launcher path on a CPU machine: Ray declares logical GPUs.

`launch/cluster.py --target-gpus 0-3 --draft-gpu 4` (and `0,1` / `2`, and a
colocated `0` / `0`) goes through the real placement: GPU bundles, actor
options, CUDA_VISIBLE_DEVICES per actor, tensor-parallel init. The config's
`cluster.compute_device: cpu` then makes the actors compute on the CPU, so
the tiny pair generates, and its greedy output must equal AR's.
"""

from __future__ import annotations

import dataclasses
import pytest
import ray
import yaml

from ssd.app import launcher  # launch/cluster.py's main
from ssd.cluster.placing import actor_env, refuse_unworkable
from ssd.cluster.runtime import Cluster
from ssd.config import ConfigError, GenerationConfig, load_config
from ssd.engine.request import GenerationRequest
from tests.conftest import ROOT
from tests.test_cluster import GREEDY, local_ar

pytestmark = pytest.mark.cluster


PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def logical_gpus(own_ray):
    """A Ray instance on this CPU machine that declares five GPUs."""
    assert not ray.is_initialized()
    ray.init(num_cpus=6, num_gpus=5, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """The tiny cluster pair, with heads that split four ways, computing on the CPU."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-cluster.yaml").read_text())
    for role in ("target", "draft"):
        data[role]["tiny"].update(num_attention_heads=4, num_key_value_heads=4)
    data["cluster"]["compute_device"] = "cpu"
    path = tmp_path_factory.mktemp("gpu") / "tiny-logical-gpus.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def parse(argv: list[str], config_path):
    """What launch/cluster.py makes of its arguments: (config, placement)."""
    args = launcher.parse_args([*argv, "--config", str(config_path)])
    return launcher.config_from_args(args), launcher.placement_from_args(args, with_draft=True)


def start(argv: list[str], config_path) -> Cluster:
    """What launch/cluster.py does before serving: parse, place, start."""
    return Cluster(*parse(argv, config_path))


@pytest.mark.parametrize("target, draft", [("0-1", "4")])  # "0,1" / "2": the launcher test below
def test_each_actor_gets_its_gpu_and_greedy_ssd_equals_ar(logical_gpus, config_path, target, draft):
    cluster = start(["--target-gpus", target, "--draft-gpu", draft], config_path)
    actors = [*cluster.targets, cluster.draft]
    try:
        seen = ray.get([a.whereabouts.remote() for a in actors])
        assert [w["placed_gpu"] for w in seen] == [str(d) for d in cluster.placement.target + (int(draft),)]
        assert all(w["device"] == "cpu" for w in seen)  # compute_device: cpu ...
        assert all(w["CUDA_VISIBLE_DEVICES"] == "" for w in seen)  # ... so no GPU is visible
        ranks = seen[:-1]
        assert [w["rank"] for w in ranks] == list(range(len(ranks)))
        if len(ranks) > 1:  # computing on the CPU: no GPU to pick, local rank 0 (tp.init_tp_world)
            assert all(w["LOCAL_RANK"] == "0" for w in ranks)
        out = cluster.generate(GenerationRequest(PROMPT, GREEDY, GenerationConfig(max_new_tokens=24)))
        assert out.token_ids == local_ar(cluster.config, PROMPT, 24)
        assert out.stats.mode == "ssd" and out.stats.spec.hits > 0
    finally:
        cluster.shutdown()
    for actor in actors:  # shut down clean: no actor survives
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(), timeout=30)


def test_colocated_roles_share_one_gpu(logical_gpus, config_path):
    with start(["--target-gpus", "0", "--draft-gpu", "0", "--colocate"], config_path) as cluster:
        seen = ray.get([cluster.targets[0].whereabouts.remote(), cluster.draft.whereabouts.remote()])
        assert [w["placed_gpu"] for w in seen] == ["0", "0"]
        assert cluster.placement.gpu_share(0) == 0.5
        out = cluster.generate(GenerationRequest(PROMPT, GREEDY, GenerationConfig(max_new_tokens=24)))
        assert out.token_ids == local_ar(cluster.config, PROMPT, 24)


def test_the_launcher_runs_a_prompt_on_logical_gpus(logical_gpus, config_path, capsys):
    assert launcher.main(["--target-gpus", "0,1", "--draft-gpu", "2", "--config", str(config_path), "abc"]) == 0
    config = load_config(config_path)
    from ssd.models import load_tokenizer

    tokenizer = load_tokenizer(config.target)
    expected = local_ar(config, tokenizer.encode("abc"), config.generation.max_new_tokens)
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_overlapping_gpus_need_colocate(logical_gpus, config_path):
    args = launcher.parse_args(["--target-gpus", "0", "--draft-gpu", "0", "--config", str(config_path)])
    with pytest.raises(launcher.DeviceError, match="--colocate"):
        launcher.placement_from_args(args, with_draft=True)


def test_int8_on_a_gpu_is_refused_naming_the_option(config_path):
    config = load_config(config_path)
    gpu_config = dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, compute_device=None))
    int8_draft = dataclasses.replace(gpu_config, draft=dataclasses.replace(config.draft, quantization="int8"))
    placement = launcher.plan_placement("0", "1", 2, "cuda")
    with pytest.raises(ConfigError, match="draft.quantization"):
        refuse_unworkable(int8_draft, placement)
    refuse_unworkable(dataclasses.replace(int8_draft, cluster=config.cluster), placement)  # computing on CPU: fine


def test_compute_device_and_backends_follow_the_placement_not_the_host(config_path, monkeypatch):
    """--cpu on a GPU host computes on the CPU; the link is gloo everywhere; TP
    all-reduces of CUDA tensors go over NCCL, control over gloo."""
    import torch

    from ssd.cluster.placing import compute_device
    from ssd.models.tp import tp_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    config = load_config(ROOT / "configs" / "tiny-cluster.yaml")
    args = launcher.parse_args(["--cpu", "--config", str(config_path)])
    placement = launcher.placement_from_args(args, with_draft=True)
    assert placement.kind == "cpu" and compute_device(config, placement) == "cpu"
    assert compute_device(config, launcher.plan_placement("0", "1", 2, "cuda")) == "cuda"
    assert config.cluster.link_backend == "gloo"
    assert tp_backend("cuda") == "cpu:gloo,cuda:nccl" and tp_backend("cpu") == "gloo"


def test_actors_computing_on_the_cpu_see_no_gpu():
    """--cpu on a GPU host (or compute_device: cpu): an empty CUDA_VISIBLE_DEVICES,
    else transformers puts every tensor-parallel rank's shard on cuda:0."""
    assert actor_env("cpu", (1,), 0, "cpu")["CUDA_VISIBLE_DEVICES"] == ""
    placed_on_cpu = actor_env("cuda", (2, 3), 1, "cpu")
    assert placed_on_cpu["CUDA_VISIBLE_DEVICES"] == "" and placed_on_cpu["SSD_PLACED_GPU"] == "3"
    assert "LOCAL_RANK" not in placed_on_cpu  # tp.init_tp_world: 0


@pytest.mark.parametrize("target, draft, colocate", [("0-3", "4", False), ("0,1", "2", False), ("0", "0", True)])
def test_every_target_rank_sees_the_target_s_gpus_and_picks_its_own(target, draft, colocate):
    """The card's layouts: each target rank sees the target's GPU list with LOCAL_RANK its index,
    the draft sees its own GPU alone (vLLM's and Ray Train's way; NVIDIA/nccl#129)."""
    placement = launcher.plan_placement(target, draft, 5, "cuda", colocate=colocate)
    gpus = ",".join(map(str, placement.target))
    for rank, device in enumerate(placement.target):
        env = actor_env("cuda", placement.target, rank, "cuda")
        assert env["CUDA_VISIBLE_DEVICES"] == gpus and env["LOCAL_RANK"] == str(rank)
        assert env["SSD_PLACED_GPU"] == str(device) and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    env = actor_env("cuda", placement.draft, 0, "cuda")
    assert env["CUDA_VISIBLE_DEVICES"] == draft and env["LOCAL_RANK"] == "0" and env["SSD_PLACED_GPU"] == draft


def test_a_tensor_parallel_rank_takes_its_local_rank_s_gpu(monkeypatch):
    from ssd.models import tp

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert tp.local_gpu() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert tp.local_gpu() == 0


def test_a_tensor_parallel_target_is_planned_through_its_group(logical_gpus, config_path, tmp_path, monkeypatch):
    """`--target-gpus 0,1 --draft-gpu 2` with the start-up plan: the target's probes run on rank 0
    with rank 1 mirroring each forward, under a key of their own, and the plan's K, budget and
    k_policy are what the target runs."""
    from ssd.models import tp

    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))  # the driver reads and writes the plans
    config, placement = parse(["--target-gpus", "0,1", "--draft-gpu", "2"], config_path)
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, plan=True))
    with Cluster(config, placement) as cluster:
        plan, chosen = cluster.plan, cluster.config.speculation
        assert "target tp2" in plan.meta["devices"]
        assert (chosen.k, chosen.fanout.budget, chosen.k_policy) == (plan.best.k, plan.best.budget, plan.k_policy)
        assert ray.get(cluster.targets[0].__ray_call__.remote(lambda self: self.config.speculation)) == chosen
        mirrored = ray.get(cluster.targets[1].__ray_call__.remote(lambda self: tp.commands_mirrored()))
        assert mirrored > 10  # the probes' forwards ran on both ranks (a start alone mirrors 2)
        out = cluster.generate(GenerationRequest(PROMPT, GREEDY, GenerationConfig(max_new_tokens=24)))
        assert out.token_ids == local_ar(cluster.config, PROMPT, 24)
