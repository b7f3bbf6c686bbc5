"""Which interface a node's ranks advertise to the other nodes (orchestrator/remote/runs/net.py):
the pure choice from `ip -o addr` output, and its refusals."""
from orchestrator.remote.runs.net import _addresses, _interface_of, _node_network

# `ip -o addr` in a container whose hostname maps to 127.0.1.1, training link on eth1
IP = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: eth0@if12    inet 192.168.1.20/24 brd 192.168.1.255 scope global eth0\\       valid_lft forever preferred_lft forever
3: eth1@if14    inet 10.10.0.20/24 brd 10.10.0.255 scope global eth1\\       valid_lft forever preferred_lft forever
3: eth1@if14    inet 10.10.0.21/24 scope global secondary eth1:1\\       valid_lft forever preferred_lft forever
3: eth1@if14    inet6 fd00:10::20/64 scope global \\       valid_lft forever preferred_lft forever
4: dummy0    inet 127.0.5.1/8 scope host dummy0\\       valid_lft forever preferred_lft forever
"""


def test_the_interface_holding_an_address_is_found():
    assert _interface_of(IP, "10.10.0.20") == "eth1"
    assert _interface_of(IP, "10.10.0.21") == "eth1"           # a secondary address, labelled eth1:1
    assert _interface_of(IP, "fd00:10:0::20") == "eth1"        # the same IPv6 address, spelled otherwise
    assert _interface_of(IP, "192.168.1.20") == "eth0"         # eth0@if12: the peer suffix is not the name
    assert _interface_of(IP, "10.10.0.99") is None
    assert _interface_of(IP, "trainer.example") is None
    assert [n for n, _ in _addresses("garbage\n\n2: x inet notanaddress/3\n")] == []


def test_the_training_interface_goes_to_gloo_and_nccl_unless_env_sets_them():
    add, why = _node_network("10.10.0.20", {}, IP, "ct200")
    assert why is None and add == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}
    add, why = _node_network("10.10.0.20", {"NCCL_SOCKET_IFNAME": "ib0"}, IP, "ct200")
    assert why is None and add == {"GLOO_SOCKET_IFNAME": "eth1"}


def test_a_node_that_would_advertise_a_loopback_address_is_refused_in_one_line():
    cases = {
        ("127.0.0.1", ()): "train_address 127.0.0.1 is a loopback address, which the other nodes cannot reach; "
                           "set train_address: in hosts.yaml",
        ("10.10.0.99", ()): "train_address 10.10.0.99 is not an address of this container (its addresses: "
                            "eth0 192.168.1.20, eth1 10.10.0.20, eth1 10.10.0.21, eth1 fd00:10::20)",
        ("10.10.0.20", ("GLOO_SOCKET_IFNAME", "lo")): "GLOO_SOCKET_IFNAME=lo names a loopback interface: the ranks "
                                                      "would advertise a loopback address to the other nodes; "
                                                      "name the training interface (eth1) instead",
        ("10.10.0.20", ("NCCL_SOCKET_IFNAME", "=dummy0")): "NCCL_SOCKET_IFNAME==dummy0 names a loopback",
    }
    for (address, var), said in cases.items():
        add, why = _node_network(address, dict([var]) if var else {}, IP, "ct200")
        assert add is None and why.startswith(said) and "\n" not in why, why


def test_without_ip_the_hostname_decides():
    add, why = _node_network("10.10.0.20", {}, None, "localhost")
    assert add is None and "hostname 'localhost', 127.0.0.1," in why
    assert "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in env:" in why
    add, why = _node_network("10.10.0.20", {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"},
                             None, "localhost")
    assert (add, why) == ({}, None)
