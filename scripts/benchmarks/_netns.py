"""Several "hosts" on one machine: network namespaces joined by a bridge.

Each host is a network namespace with one veth link into a switch namespace
that holds a bridge, so every host reaches every other at 10.213.48.<i+1>.
Ranks started in the same namespace share a host (and its shared memory, as
ringreduce sees it: its host identity includes the network namespace); ranks
in different namespaces talk over TCP through the veth links. Needs root and
iproute2 (`ip netns`); `rate` shapes each host's link with a token bucket
(tc), to model a NIC slower than memory.

    with Hosts(3) as hosts:
        subprocess.run(hosts.exec(0, ["python", "rank.py"]), env=hosts.env(0))
"""
import subprocess
import uuid

SUBNET = "10.213.48"  # inside the sandbox only: namespaces made here


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2)."""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Hosts:
    def __init__(self, count, rate=None):
        self.count = count
        self.rate = rate
        tag = uuid.uuid4().hex[:6]
        self.switch = f"rr{tag}s"
        self.names = [f"rr{tag}h{i}" for i in range(count)]
        self.links = [f"rv{tag}{i}" for i in range(count)]  # the host's end
        self._made = []

    def address(self, host):
        return f"{SUBNET}.{host + 1}"

    def exec(self, host, argv):
        """The command line that runs `argv` on host `host`."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def env(self, host):
        """What a rank on `host` needs for gloo and ringreduce to find the link."""
        return {"GLOO_SOCKET_IFNAME": self.links[host], "MASTER_ADDR": self.address(0)}

    def __enter__(self):
        try:
            _ip("netns", "add", self.switch)
        except (subprocess.CalledProcessError, FileNotFoundError) as err:
            raise Unavailable(f"network namespaces unavailable (needs root and iproute2): "
                              f"{getattr(err, 'stderr', '') or err}") from err
        self._made.append(self.switch)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (name, link) in enumerate(zip(self.names, self.links)):
                _ip("netns", "add", name)
                self._made.append(name)
                port = f"rs{link[2:]}"
                _ip("link", "add", link, "type", "veth", "peer", "name", port)
                _ip("link", "set", link, "netns", name)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if self.rate:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev",
                                    link, "root", "tbf", "rate", self.rate, "burst", "1mb",
                                    "latency", "100ms"], check=True, capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
