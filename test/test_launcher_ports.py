"""Servers started side by side get different ports (``launcher.free_port``).

Six servers of one test module pick their ports one after another before any of them binds, so "free now" is not
enough: a test run once gave two of them the same port and the second server died with "address already in use".
"""

import socket

import pytest

from sglang_tree_v4.testing import launcher

LOW = 31000
WIDTH = 6


@pytest.fixture
def narrow_range(monkeypatch):
    """The launcher's range cut to six ports, tried in order (not at random), with nothing handed out yet: the
    worst case for picks made before anything binds."""
    monkeypatch.setattr(launcher, "SERVER_PORTS", range(LOW, LOW + WIDTH))
    monkeypatch.setattr(launcher, "_handed_out", set())
    monkeypatch.setattr(launcher.random, "sample", lambda ports, k: list(ports)[:k])


def test_ports_picked_before_any_server_binds_are_all_different(narrow_range):
    ports = [launcher.free_port() for _ in range(WIDTH)]
    assert sorted(ports) == list(range(LOW, LOW + WIDTH))


def test_control_without_the_record_of_handed_out_ports_the_same_port_comes_twice(narrow_range):
    first = launcher.free_port()
    launcher._handed_out.clear()
    assert launcher.free_port() == first


def test_a_port_in_use_is_skipped(narrow_range):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", LOW))
        assert launcher.free_port() == LOW + 1
