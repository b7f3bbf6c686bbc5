"""Runs agent: the training network of one node of a job over several.

The ranks of a node tell the other nodes where to reach them: gloo and NCCL advertise the address
of the interface named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else the address the hostname
resolves to, which in Debian and Proxmox containers is often 127.0.1.1 (/etc/hosts): the other
nodes then dial themselves and the mesh never forms. So launch finds the interface that holds the
node's train_address in the container (`ip -o addr`) and names it to both, unless `env:` sets
them; a node whose ranks would still advertise a loopback address is refused before anything
starts, in one line saying what to set.
"""
import ipaddress
import socket
import subprocess

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _addresses(ip_output):
    """[(interface, address)] from `ip -o addr` output (address without its /prefix)."""
    found = []
    for line in ip_output.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] in ("inet", "inet6"):
            name = words[1].split("@")[0].rstrip(":")
            try:
                found.append((name, ipaddress.ip_address(words[3].split("/")[0])))
            except ValueError:
                continue
    return found


def _interface_of(ip_output, address):
    """The interface that holds `address` in `ip -o addr` output, or None."""
    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addr in _addresses(ip_output):
        if addr == want:
            return name
    return None


def _address_of(name):
    """The address `name` resolves to (an address stays itself), or None."""
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(name))
    except (OSError, ValueError):
        return None


def _ip_addr():
    """`ip -o addr`'s output, or None where `ip` is missing or fails."""
    try:
        proc = subprocess.run(["ip", "-o", "addr"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.decode("utf-8", "replace") if proc.returncode == 0 else None


def _node_network(address, env, ip_output, hostname):
    """(variables to add to the trainer's environment, None) or (None, why this node cannot join
    the others): `address` is the node's train_address, `env` the variables already set (the
    inventory's env: and launch --env), `ip_output` `ip -o addr`'s output (None: unknown)."""
    what = "set train_address: in hosts.yaml to this container's address on the training network"
    addr = _address_of(address)
    if addr is not None and addr.is_loopback:
        return None, "train_address %s is a loopback address, which the other nodes cannot reach; %s" % (
            address, what)
    iface = _interface_of(ip_output, str(addr)) if ip_output is not None and addr is not None else None
    if ip_output is not None and iface is None:
        have = ", ".join("%s %s" % (n, a) for n, a in _addresses(ip_output) if not a.is_loopback) or "none"
        return None, "train_address %s is not an address of this container (its addresses: %s); %s" % (
            address, have, what)
    if iface is not None and _addresses_loopback(ip_output, iface):
        return None, "train_address %s is on the loopback interface %s; %s" % (address, iface, what)
    add = {}
    for var in IFNAME_VARS:
        given = env.get(var)
        if given:
            names = [n.lstrip("=^") for n in given.split(",")]
            if ip_output is not None and names and all(_addresses_loopback(ip_output, n) for n in names):
                return None, ("%s=%s names a loopback interface: the ranks would advertise a loopback "
                              "address to the other nodes; name the training interface%s instead" % (
                                  var, given, " (%s)" % iface if iface else ""))
        elif iface is not None:
            add[var] = iface if var == "GLOO_SOCKET_IFNAME" else "=" + iface    # NCCL: exact name, not a prefix
    if len(add) + sum(1 for v in IFNAME_VARS if env.get(v)) < len(IFNAME_VARS):
        own = _address_of(hostname)
        if own is None or own.is_loopback:
            return None, ("the ranks would advertise the address of this container's hostname %r, %s, to "
                          "the other nodes, and which interface holds train_address %s is unknown (no "
                          "`ip`); set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in env: to the training "
                          "interface" % (hostname, own or "which does not resolve", address))
    return add, None


def _addresses_loopback(ip_output, iface):
    """Whether interface `iface` holds loopback addresses only (or is `lo`)."""
    addrs = [a for n, a in _addresses(ip_output) if n == iface]
    return iface == "lo" or (bool(addrs) and all(a.is_loopback for a in addrs))


def network_env(nodes, env):
    """_node_network for this container: the variables, or (None, why)."""
    return _node_network(nodes["address"], env, _ip_addr(), socket.gethostname())
