"""meshrun.mesh.coordinator.rendezvous: the rendezvous service on MemoryKV (CAS, counters, torch's compare_set,
who may call, malformed bodies and caps) and its HTTP answers."""

from __future__ import annotations

import base64
import threading

import pytest

from meshrun.errors import AuthError, CoordinatorError, HostError, StateError, UsageError
from meshrun.mesh.coordinator import rendezvous
from meshrun.mesh.coordinator.rendezvous import MemoryKV, RendezvousService, http_status
from meshrun.system.sockets.transport import Request

NODES = {"10.77.0.2", "10.77.0.3"}
A, B = sorted(NODES)


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class RecordingKV(MemoryKV):
    """A MemoryKV that records every call made to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def get(self, key):
        self.calls.append(("get", key))
        return super().get(key)

    def put_if(self, key, value, version):
        self.calls.append(("put_if", key))
        return super().put_if(key, value, version)

    def delete(self, key):
        self.calls.append(("delete", key))
        return super().delete(key)

    def keys(self, prefix):
        self.calls.append(("keys", prefix))
        return super().keys(prefix)


@pytest.fixture
def kv() -> RecordingKV:
    return RecordingKV()


@pytest.fixture
def svc(kv) -> RendezvousService:
    return RendezvousService(kv, lambda job: NODES if job in ("J", "J2") else None)


def op(svc: RendezvousService, name: str, job: str = "J", caller: str = A, **fields) -> dict:
    return svc.handle(caller, job, {"op": name, **fields})


class TestMemoryKV:
    def test_put_if_creates_only_absent_keys_and_every_write_changes_the_version(self):
        kv = MemoryKV()
        assert kv.get("k") is None
        assert kv.put_if("k", b"1", 0)
        value, v1 = kv.get("k")
        assert value == b"1" and v1 > 0
        assert not kv.put_if("k", b"2", 0)  # exists
        assert not kv.put_if("k", b"2", v1 + 1)  # not its version
        assert kv.put_if("k", b"1", v1)  # the same bytes again are a new version
        assert kv.get("k")[1] > v1

    def test_a_deleted_keys_version_never_comes_back(self):
        kv = MemoryKV()
        kv.put_if("k", b"1", 0)
        _, old = kv.get("k")
        kv.delete("k")
        kv.delete("k")  # nothing to delete: no error
        assert not kv.put_if("k", b"2", old)
        assert kv.put_if("k", b"2", 0) and kv.get("k")[1] != old

    def test_keys_lists_a_prefix(self):
        kv = MemoryKV()
        for k in ("rdzv/J/a", "rdzv/J/b", "rdzv/J2/a"):
            kv.put_if(k, b"", 0)
        assert kv.keys("rdzv/J/") == ["rdzv/J/a", "rdzv/J/b"]


class TestState:
    def test_no_state_yet(self, svc):
        assert op(svc, "get_state") == {"state": None, "token": None}

    def test_set_state_follows_torchs_rendezvous_backend(self, svc):
        # No token: written only when there is no state yet.
        first = op(svc, "set_state", state=b64("s1"), token=None)
        assert first["ok"] and unb64(first["state"]) == b"s1" and first["token"]
        again = op(svc, "set_state", state=b64("other"), token=None)
        assert again == {**first, "ok": False}
        # The current token: written, and a new token comes back.
        second = op(svc, "set_state", state=b64("s2"), token=first["token"])
        assert second["ok"] and unb64(second["state"]) == b"s2" and second["token"] != first["token"]
        # A stale token: nothing written, the current state and token come back.
        stale = op(svc, "set_state", state=b64("s3"), token=first["token"])
        assert stale == {**second, "ok": False}
        assert op(svc, "get_state") == {"state": second["state"], "token": second["token"]}

    @pytest.mark.parametrize("token", ["abc", "0", "-1", "²", "1" * 40, ""])
    def test_a_token_that_cannot_be_one_matches_nothing(self, svc, token):
        first = op(svc, "set_state", state=b64("s1"))
        assert op(svc, "set_state", state=b64("s2"), token=token) == {**first, "ok": False}

    def test_a_token_with_no_state_matches_nothing(self, svc):
        assert op(svc, "set_state", state=b64("s"), token="5") == {"state": None, "token": None, "ok": False}

    def test_two_writers_with_one_token_exactly_one_wins(self, svc):
        token = op(svc, "set_state", state=b64("s0"))["token"]
        for _round in range(20):
            start = threading.Barrier(8)
            results: list[dict] = []

            def write(i: int, token: str = token) -> None:
                start.wait()
                results.append(op(svc, "set_state", state=b64(f"writer {i}"), token=token))

            threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            winners = [r for r in results if r["ok"]]
            assert len(winners) == 1
            now = op(svc, "get_state")
            assert now["state"] == winners[0]["state"] and now["token"] == winners[0]["token"]
            assert all(r["token"] == now["token"] for r in results)  # losers see the winner's state
            token = now["token"]

    def test_jobs_do_not_share_state(self, svc):
        op(svc, "set_state", state=b64("s"), job="J")
        assert op(svc, "get_state", job="J2") == {"state": None, "token": None}


class TestStore:
    def test_set_get_check_delete(self, svc):
        assert op(svc, "get", key="k") == {"found": False}
        assert op(svc, "set", key="k", value=b64(b"\x00\xff")) == {}
        assert op(svc, "get", key="k") == {"found": True, "value": b64(b"\x00\xff")}
        op(svc, "set", key="k", value=b64("v2"))
        assert unb64(op(svc, "get", key="k")["value"]) == b"v2"
        assert op(svc, "check", keys=["k"]) == {"ok": True}
        assert op(svc, "check", keys=["k", "nope"]) == {"ok": False}
        assert op(svc, "check", keys=[]) == {"ok": True}
        assert op(svc, "delete_key", key="k") == {"deleted": True}
        assert op(svc, "delete_key", key="k") == {"deleted": False}
        assert op(svc, "get", key="k") == {"found": False}

    def test_multi_set_multi_get_and_num_keys(self, svc):
        op(svc, "multi_set", keys=["a", "b/c", "a"], values=[b64("1"), b64("2"), b64("3")])
        assert op(svc, "multi_get", keys=["a", "b/c", "zz"]) == {"values": [b64("3"), b64("2"), None]}
        op(svc, "set_state", state=b64("s"))  # not a store key
        assert op(svc, "num_keys") == {"count": 2}
        assert op(svc, "num_keys", job="J2") == {"count": 0}

    def test_add_counts_from_zero_and_takes_negative_amounts(self, svc):
        assert op(svc, "add", key="n", amount=5) == {"value": 5}
        assert op(svc, "add", key="n", amount=-7) == {"value": -2}
        assert op(svc, "get", key="n")["value"] == b64("-2")
        op(svc, "set", key="m", value=b64("40"))
        assert op(svc, "add", key="m", amount=2) == {"value": 42}

    def test_add_under_contention_counts_every_add_once(self, svc):
        results: list[int] = []
        lock = threading.Lock()

        def adder() -> None:
            for _ in range(40):
                value = op(svc, "add", key="n", amount=1)["value"]
                with lock:
                    results.append(value)

        threads = [threading.Thread(target=adder) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(1, 321))
        assert op(svc, "get", key="n")["value"] == b64("320")

    def test_an_add_sent_again_with_its_id_counts_once(self, svc):
        assert op(svc, "add", key="n", amount=1, id="a" * 32) == {"value": 1}
        assert op(svc, "add", key="n", amount=1, id="b" * 32) == {"value": 2}
        assert op(svc, "add", key="n", amount=1, id="a" * 32) == {"value": 1}  # its answer, not a third add
        assert op(svc, "get", key="n")["value"] == b64("2")

    def test_add_to_a_value_that_is_no_integer_is_refused(self, svc):
        op(svc, "set", key="k", value=b64("abc"))
        with pytest.raises(UsageError, match="integer"):
            op(svc, "add", key="k", amount=1)

    def test_add_may_not_overflow_64_bits(self, svc):
        op(svc, "set", key="k", value=b64(str(2**63 - 1)))
        with pytest.raises(UsageError, match="overflow"):
            op(svc, "add", key="k", amount=1)

    # (the key's value or None when missing, expected, desired, the answer, the key's value after): what torch
    # 2.13's TCPStore and HashStore do (tests/unit/jobs/test_rdzv_backend_ha.py checks it against HashStore).
    COMPARE_SET_CASES = [
        (None, "", "x", "x", "x"),  # missing, expected empty: created
        (None, "q", "x", "q", None),  # missing, expected not empty: not created, and the answer is `expected`
        ("v", "v", "w", "w", "w"),  # a match: replaced
        ("v", "u", "w", "v", "v"),  # no match: the current value
        ("v", "", "w", "v", "v"),  # expected empty, but the key holds something: the current value
        ("", "", "w", "w", "w"),  # the key holds the empty value: a match
    ]

    @pytest.mark.parametrize("current,expected,desired,answer,after", COMPARE_SET_CASES)
    def test_compare_set_answers_what_torchs_own_stores_answer(self, svc, current, expected, desired, answer, after):
        if current is not None:
            op(svc, "set", key="k", value=b64(current))
        got = op(svc, "compare_set", key="k", expected=b64(expected), desired=b64(desired))
        assert unb64(got["value"]) == answer.encode()
        now = op(svc, "get", key="k")
        assert (unb64(now["value"]) if now["found"] else None) == (after.encode() if after is not None else None)

    def test_compare_set_under_contention_lets_one_writer_through(self, svc):
        op(svc, "set", key="lock", value=b64("free"))
        start = threading.Barrier(8)
        won: list[int] = []

        def take(i: int) -> None:
            start.wait()
            got = op(svc, "compare_set", key="lock", expected=b64("free"), desired=b64(f"held by {i}"))
            if unb64(got["value"]) == f"held by {i}".encode():
                won.append(i)

        threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1

    def test_jobs_do_not_share_keys_and_forget_removes_one_jobs(self, svc, kv):
        op(svc, "set", key="k", value=b64("j"), job="J")
        op(svc, "set_state", state=b64("s"), job="J")
        op(svc, "add", key="n", amount=1, id="x" * 16, job="J")
        op(svc, "set", key="k", value=b64("j2"), job="J2")
        assert op(svc, "get", key="k", job="J2")["value"] == b64("j2")
        svc.forget("J")
        assert kv.keys("rdzv/J/") == []
        assert op(svc, "get_state", job="J") == {"state": None, "token": None}
        assert op(svc, "get", key="k", job="J2")["value"] == b64("j2")


class TestWhoMayCall:
    def test_a_caller_outside_the_job_is_refused_before_the_store_is_read(self, svc, kv):
        for name in ("get_state", "set_state", "set", "get", "add", "multi_get", "num_keys"):
            with pytest.raises(AuthError, match="10.77.0.9"):
                op(svc, name, caller="10.77.0.9", key="k", state=b64("s"), value=b64("v"), keys=["k"], amount=1)
        assert kv.calls == []

    def test_the_caller_check_comes_before_the_body_is_looked_at(self, svc, kv):
        with pytest.raises(AuthError):
            svc.handle("10.77.0.9", "J", "not even an object")
        assert kv.calls == []

    def test_a_job_that_does_not_run_is_refused(self, svc, kv):
        with pytest.raises(StateError, match="no job 'other'"):
            op(svc, "get_state", job="other")
        assert kv.calls == []

    @pytest.mark.parametrize("job", ["", ".", "..", "a/b", "x" * 65, "j b", None, 7])
    def test_a_malformed_job_id_is_refused_before_members_of_is_asked(self, kv, job):
        asked = []
        svc = RendezvousService(kv, lambda j: asked.append(j) or NODES)
        with pytest.raises(UsageError, match="job id"):
            svc.handle(A, job, {"op": "get_state"})
        assert asked == [] and kv.calls == []

    def test_every_node_of_the_job_may_call(self, svc):
        op(svc, "set", key="k", value=b64("v"), caller=A)
        assert op(svc, "get", key="k", caller=B)["found"]


class TestMalformed:
    @pytest.mark.parametrize(
        "body,match",
        [
            ("a string", "JSON object"),
            ([], "JSON object"),
            ({}, "unknown rendezvous operation"),
            ({"op": "rm -rf"}, "unknown rendezvous operation"),
            ({"op": 3}, "unknown rendezvous operation"),
            ({"op": "set_state"}, "state must be base64"),
            ({"op": "set_state", "state": "not base64!"}, "not base64"),
            ({"op": "set_state", "state": b64("s"), "token": 5}, "token"),
            ({"op": "set", "value": b64("v")}, "store key"),
            ({"op": "set", "key": "", "value": b64("v")}, "store key"),
            ({"op": "set", "key": 5, "value": b64("v")}, "store key"),
            ({"op": "set", "key": "k" * (rendezvous.MAX_KEY + 1), "value": b64("v")}, "store key"),
            ({"op": "set", "key": "k", "value": None}, "base64"),
            ({"op": "set", "key": "k", "value": b64(b"x" * (rendezvous.MAX_VALUE + 1))}, "at most"),
            ({"op": "add", "key": "k"}, "amount"),
            ({"op": "add", "key": "k", "amount": True}, "amount"),
            ({"op": "add", "key": "k", "amount": 1.5}, "amount"),
            ({"op": "add", "key": "k", "amount": 2**63}, "amount"),
            ({"op": "add", "key": "k", "amount": 1, "id": "short"}, "id"),
            ({"op": "add", "key": "k", "amount": 1, "id": "../../etc/passwd"}, "id"),
            ({"op": "compare_set", "key": "k", "expected": b64("a")}, "desired"),
            ({"op": "check", "keys": "k"}, "list"),
            ({"op": "check", "keys": ["k"] * (rendezvous.MAX_BATCH + 1)}, "at most"),
            ({"op": "multi_get", "keys": ["k", None]}, "store key"),
            ({"op": "multi_set", "keys": ["a", "b"], "values": [b64("1")]}, "as many values"),
            ({"op": "multi_set", "keys": ["a"], "values": "x"}, "as many values"),
        ],
    )
    def test_is_refused_as_a_usage_error(self, svc, body, match):
        with pytest.raises(UsageError, match=match):
            svc.handle(A, "J", body)

    def test_multi_set_values_may_not_add_up_past_the_cap(self, svc, monkeypatch):
        half = b64(b"x" * (rendezvous.MAX_VALUE // 2 + 1))
        with pytest.raises(UsageError, match="come to over"):
            op(svc, "multi_set", keys=["a", "b"], values=[half, half])
        assert op(svc, "check", keys=["a"]) == {"ok": False}  # nothing of it was written

    def test_a_multi_get_answer_is_capped(self, svc, monkeypatch):
        monkeypatch.setattr(rendezvous, "MAX_ANSWER", 10)
        op(svc, "multi_set", keys=["a", "b"], values=[b64("123456"), b64("123456")])
        with pytest.raises(UsageError, match="over 10 bytes"):
            op(svc, "multi_get", keys=["a", "b"])


class TestHTTP:
    def serve(self, svc, body, path="/v1/rdzv/J", method="POST", caller=A):
        return svc.serve(Request(method, path, caller, body))

    def test_answers_200_with_the_result(self, svc):
        resp = self.serve(svc, {"op": "get_state"})
        assert (resp.status, resp.body) == (200, {"state": None, "token": None})

    def test_errors_carry_their_class_and_status(self, svc):
        cases = [
            (self.serve(svc, {"op": "nope"}), 400, "UsageError"),
            (self.serve(svc, {"op": "get_state"}, caller="10.77.0.9"), 403, "AuthError"),
            (self.serve(svc, {"op": "get_state"}, path="/v1/rdzv/other"), 404, "StateError"),
            (self.serve(svc, {"op": "get_state"}, path="/v1/rdzv/a/b"), 400, "UsageError"),
            (self.serve(svc, None, method="GET"), 405, "UsageError"),
        ]
        for resp, status, kind in cases:
            assert (resp.status, resp.body["kind"]) == (status, kind)
            assert resp.body["fix"]

    def test_a_store_that_cannot_answer_is_a_503_so_the_agent_tries_another_coordinator(self):
        class DownKV(MemoryKV):
            def get(self, key):
                raise CoordinatorError("no etcd majority answers", "wait for etcd")

        resp = RendezvousService(DownKV(), lambda job: NODES).serve(
            Request("POST", "/v1/rdzv/J", A, {"op": "get", "key": "k"})
        )
        assert (resp.status, resp.body["kind"]) == (503, "CoordinatorError")

    def test_a_store_connection_error_is_a_503_too(self):
        class BrokenKV(MemoryKV):
            def get(self, key):
                raise ConnectionResetError("etcd went away")

        resp = RendezvousService(BrokenKV(), lambda job: NODES).serve(
            Request("POST", "/v1/rdzv/J", A, {"op": "get_state"})
        )
        assert (resp.status, resp.body["kind"]) == (503, "CoordinatorError")

    def test_http_status_of_each_class(self):
        assert http_status(AuthError("x")) == 403
        assert http_status(StateError("x")) == 404
        assert http_status(UsageError("x")) == 400
        assert http_status(CoordinatorError("x")) == 503
        assert http_status(HostError("x")) == 503  # any other error is this coordinator's trouble
