"""Several generation replicas, without servers: the config's rules (what ``start`` refuses, with the key to change),
the cores each replica gets, the fit check's numbers, the handle's round trip, the router's command line, and the
session an episode's turns are routed by."""

import pytest

from grpo_steps import servers
from grpo_steps.config import validate_config
from grpo_steps.servers.client import session_id
from grpo_steps.servers.local import replicas_fit
from grpo_steps.servers.router import router_command
from grpo_steps.training.generation.server import RolloutBackend


def config(**server):
    return validate_config({"generation": {"server": server}})


@pytest.mark.parametrize(("generation", "match"), [
    ({"server": {"replicas": 2}, "weight_sync": "nccl"}, "TRL's NCCL weight transfer reaches one server"),
    ({"provider": "external", "server": {"endpoint": "http://127.0.0.1:8000", "replicas": 2}},
     "list each server in generation.server.endpoints"),
    ({"provider": "external", "server": {"endpoints": ["http://127.0.0.1:8000"]}}, "two or more distinct servers"),
    ({"provider": "external", "server": {"endpoints": ["http://a:1", "http://b:2"], "replicas": 3}},
     "differs from the 2 generation.server.endpoints"),
    ({"server": {"router": {"endpoint": "http://127.0.0.1:7000"}}}, "list the replicas' endpoints too"),
    ({"server": {"replicas": 2, "cpu_cores": [[0], [1], [2]]}}, "lists cores for 3 replicas, not 2"),
    ({"server": {"replicas": 2, "cpu_cores": [[0], [0]]}}, "distinct core numbers"),
    ({"provider": "external", "server": {"endpoints": ["http://u:pw@a:1", "http://b:2"]}}, "holds credentials"),
])
def test_what_cannot_work_is_refused_with_the_key_to_change(generation, match):
    with pytest.raises(ValueError, match=match):
        validate_config({"generation": generation})


def test_each_replica_gets_its_share_of_the_cores():
    assert config(replicas=2).generation.server.replica_cores([0, 1]) == [[0], [1]]
    assert config(replicas=2).generation.server.replica_cores([0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert config(replicas=2, cpu_cores=[2, 3]).generation.server.replica_cores([0, 1, 2, 3]) == [[2], [3]]
    assert config(replicas=2, cpu_cores=[[3], [1, 2]]).generation.server.replica_cores([0]) == [[3], [1, 2]]
    assert config().generation.server.replica_cores([0, 1]) == [None]  # one server: every core, as before
    with pytest.raises(ValueError, match="needs at least one core per replica.*give 2"):
        config(replicas=3).generation.server.replica_cores([0, 1])


def test_the_fit_check_names_the_memory_each_part_needs():
    cfg = config(replicas=4, kv_cache_gib=4)
    why = replicas_fit(cfg, 500_000_000, 24 * 2**30, list(range(8)))
    assert "4 local servers need about 8.4 GiB each" in why and "more than this machine's 24.0 GiB" in why
    assert "generation.server.kv_cache_gib" in why
    assert replicas_fit(config(replicas=2), 135_000_000, 24 * 2**30, [0, 1]) is None


def test_the_router_policy_follows_the_rollouts():
    plain = validate_config({"generation": {"server": {"replicas": 2}}})
    assert plain.generation.router_policy(plain.multi_turn) == "round_robin"
    tools = validate_config({"generation": {"server": {"replicas": 2}}, "tools": ["grpo_steps.tools:calculator"]})
    assert tools.multi_turn and tools.generation.router_policy(tools.multi_turn) == "consistent_hash"
    chosen = config(replicas=2, router={"policy": "power_of_two"})
    assert chosen.generation.router_policy(True) == "power_of_two"


def test_the_router_listens_where_the_config_says_and_its_metrics_on_loopback():
    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], "127.0.0.1", 7000, policy="round_robin",
                         health_check_interval_s=5, metrics_port=7001)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "7000"
    assert cmd[cmd.index("--worker-urls") + 1: cmd.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                    "http://127.0.0.1:2"]
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert not any("key" in arg or "token" in arg for arg in cmd)  # the token travels in headers, never in argv


def test_a_replica_set_round_trips_through_its_handle():
    replica = servers.LocalServer("http://127.0.0.1:8001", model="/m", supervisor_pid=12, supervisor_started=1.5,
                                  owner_pid=3, owner_started=2.5, log_path="/tmp/vllm-8001.log")
    other = servers.LocalServer("http://127.0.0.1:8002", model="/m", supervisor_pid=13, supervisor_started=1.5,
                                owner_pid=3, owner_started=2.5, log_path="/tmp/vllm-8002.log")
    router = servers.LocalRouter("http://127.0.0.1:7000", model="vllm-router", supervisor_pid=14,
                                 supervisor_started=1.5, owner_pid=3, owner_started=2.5,
                                 metrics_endpoint="http://127.0.0.1:7001/metrics")
    replica_set = servers.ReplicaSet(router.endpoint, replicas=(replica.to_dict(), other.to_dict()),
                                     router=router.to_dict(), policy="round_robin")
    handle = replica_set.to_dict()
    assert servers.from_dict(handle) == replica_set
    assert servers.from_dict(handle).members == [replica, other] and replica_set.router_server == router
    client = replica_set.client()
    assert client.endpoint == router.endpoint and client.replicas == (replica.endpoint, other.endpoint)
    assert client.replica_logs == (replica.log_path, other.log_path)
    assert [c.endpoint for c in client.replica_clients()] == [replica.endpoint, other.endpoint]
    assert replica_set.metrics_endpoint == router.metrics_endpoint


def test_every_turn_of_an_episode_is_routed_by_its_first_turn():
    generation = RolloutBackend.__new__(RolloutBackend)
    generation._episodes = [[1, 2, 3], [1, 2], [7, 8]]  # first turns of a round (one a prefix of another)
    assert generation._session([1, 2, 3, 50, 51]) == session_id([1, 2, 3])  # the longest first turn it extends
    assert generation._session([1, 2, 9]) == session_id([1, 2])
    assert generation._session([7, 8]) == session_id([7, 8])
    assert generation._session([4, 4]) == session_id([4, 4])  # no known episode: its own
    assert len({session_id([1, 2, 3]), session_id([1, 2]), session_id([7, 8])}) == 3
