"""Mesh construction errors and the multi-process start conditions."""
import jax
import pytest

import sbd_jax.sharding as sh
from sbd_jax.config import ConfigError


def test_mesh_errors_and_fill():
    n = len(jax.devices())
    assert dict(sh.make_mesh(sh.MeshConfig()).shape) == {"data": n, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs 3 devices"):
        sh.make_mesh(sh.MeshConfig(data=3, fsdp=1, tensor=1), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        sh.make_mesh(sh.MeshConfig(data=-1, fsdp=-1))


def test_distributed_start_conditions(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in ("SBD_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not sh.maybe_initialize_distributed() and not calls
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not sh.maybe_initialize_distributed()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert sh.maybe_initialize_distributed() and calls[-1] == {}
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert sh.maybe_initialize_distributed()
    assert calls[-1] == {"coordinator_address": "host0:1234", "num_processes": 2, "process_id": 1}
    monkeypatch.setenv("SBD_DISTRIBUTED", "0")
    assert not sh.maybe_initialize_distributed()
