#!/usr/bin/env python3
"""A multi-host test cluster on one machine: network namespaces joined by an emulated switch.

Each host is a network namespace (<name>-h0, <name>-h1, ...) whose only interface, `pdsim0`, is a
TUN device with address <subnet>.(10 + i); the root namespace gets `<name>-sw` = <subnet>.1, so
that mpirun (which runs there) reaches the hosts. One switch process (this script's `switch`
command, started by `up`) holds every TUN device and forwards IPv4 packets between them, shaping
each host's link as the kernel's tc netem would: its rate (serialised per direction), its one-way
latency, a random loss probability, and up or down. A packet from host A to host B crosses A's
link and then B's. The kernel's TCP sees real delay, loss and queueing, so pdsim's transports, MPI
and mpirun's own daemons all meet the fault as they would between machines.

Why not veth + tc netem: `sch_netem` is often not built into CI kernels (this project's CI machine
answers "Specified qdisc kind is unknown"), while /dev/net/tun almost always exists. The switch is
pure Python (standard library): about 20-50k packets/s, so its links carry tens of MB/s at
most with the 65000-byte MTU it sets; plenty for the CPU testbed's tiny model, not a bandwidth
benchmark.

Usage (as root):
  netns_cluster.py up [--hosts N | --topology F] [--name N] [--subnet A.B.C] [--gbps G]
                      [--latency-us U]                     make the cluster (idempotent: down first)
  netns_cluster.py link HOST [--delay-ms D] [--loss P] [--gbps G] [--down | --up]
                                                           change a host's link while it runs
  netns_cluster.py kill HOST [--match TEXT]                kill -9 the host's processes (all: the
                                                           host is lost; --match: those running TEXT)
  netns_cluster.py exec HOST CMD...                        run CMD in the host (hostname = HOST)
  netns_cluster.py mpirun-args                             the mpirun options that launch on it
  netns_cluster.py status | down

With --topology, the hosts are the topology's nodes (their `hostname`s) and each host's link takes
the rate and latency of the node's NIC-to-switch link. `mpirun $(netns_cluster.py mpirun-args)
-np 3 ...` starts ranks in the hosts (OpenMPI's rsh launcher with this script as the agent; the
hostfile lists the hosts in order, one slot each). Exit status: 0 done; 2 bad input (named); 1 the
system refused (not root, no /dev/net/tun, `ip` missing).
"""

import argparse
import ctypes
import fcntl
import heapq
import json
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import time

STATE_ROOT = os.environ.get("PDSIM_NETNS_DIR", "/run/pdsim-netns")
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 65000
QUEUE_LIMIT_S = 0.5  # a link holding more than this much queued traffic drops (tail drop)


def fail(code, msg):
    print(f"netns_cluster.py: {msg}", file=sys.stderr)
    sys.exit(code)


def state_dir(name):
    return os.path.join(STATE_ROOT, name)


def load_state(name):
    path = os.path.join(state_dir(name), "cluster.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        fail(2, f"no cluster '{name}' is up ({path} missing): run `up` first")


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run(cmd, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        fail(1, f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
    return r


def ns_name(name, host):
    return f"{name}-{host}"


# --- the topology's hosts and links ---------------------------------------------------------

def hosts_from_topology(path):
    """[(hostname, gbps, latency_us)] per node, from a topology YAML in the flow style the
    project's generators write (`{a: X, b: Y, type: ethernet|ib, gbps: G, latency_us: U}`)."""
    try:
        text = open(path).read()
    except OSError as e:
        fail(2, f"--topology {path}: {e.strerror}")
    nodes = []  # (id, hostname)
    cur = None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*-\s*id:\s*(\S+)\s*$", line)
        if m:
            cur = m.group(1)
            continue
        m = re.match(r"\s*hostname:\s*(\S+)\s*$", line)
        if m and cur is not None:
            nodes.append((cur, m.group(1).strip("\"'")))
            cur = None
    if not nodes:
        fail(2, f"--topology {path}: no node with a hostname")
    hosts = []
    for node_id, hostname in nodes:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,7}", hostname):
            fail(2, f"--topology {path}: hostname '{hostname}' must be 1-8 letters/digits "
                    "(it names a network namespace)")
        gbps, lat = None, None
        for line in text.splitlines():
            m = re.search(r"\{a:\s*" + re.escape(node_id) + r"\.nic\d+,.*type:\s*(ethernet|ib),"
                          r"\s*gbps:\s*([0-9.eE+-]+),\s*latency_us:\s*([0-9.eE+-]+)", line)
            if m:
                gbps, lat = float(m.group(2)), float(m.group(3))
                break
        hosts.append((hostname, gbps, lat))
    return hosts


# --- the switch -----------------------------------------------------------------------------

libc = ctypes.CDLL(None, use_errno=True)


def setns(fd):
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_tun(ifname):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Link:
    """One host's link, both directions: rate (bytes/s; 0 = unlimited), latency, loss, up."""

    def __init__(self, spec):
        self.free_at = [0.0, 0.0]  # per direction: 0 up (host -> switch), 1 down
        self.update(spec)

    def update(self, spec):
        gbps = spec.get("gbps") or 0
        self.rate = gbps * 1e9
        self.delay = spec.get("latency_us", 0) / 1e6 + spec.get("delay_ms", 0) / 1e3
        self.loss = spec.get("loss", 0.0)
        self.up = spec.get("up", True)

    def cross(self, direction, size, t, now):
        """The time the packet leaves this link, or None when dropped."""
        if not self.up or (self.loss > 0 and random.random() < self.loss):
            return None
        if self.rate > 0:
            start = max(t, self.free_at[direction])
            if start - now > QUEUE_LIMIT_S:
                return None
            t = start + size / self.rate
            self.free_at[direction] = t
        return t + self.delay


def switch_main(name):
    st = load_state(name)
    sdir = state_dir(name)
    links_path = os.path.join(sdir, "links.json")
    root_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
    fds = {}  # address -> (fd, host index or -1 for the root)
    subnet = st["subnet"]
    for i, host in enumerate(st["hosts"]):
        nsfd = os.open(f"/var/run/netns/{ns_name(name, host)}", os.O_RDONLY)
        setns(nsfd)
        fds[f"{subnet}.{10 + i}"] = (open_tun("pdsim0"), i)
        os.close(nsfd)
    setns(root_ns)
    fds[f"{subnet}.1"] = (open_tun(f"{name}-sw"), -1)
    by_fd = {fd: idx for fd, idx in fds.values()}
    out_fd = {bytes(int(x) for x in a.split(".")): fd for a, (fd, _) in fds.items()}
    links = [Link(spec) for spec in json.load(open(links_path))]
    links_mtime = os.stat(links_path).st_mtime_ns
    with open(os.path.join(sdir, "switch.ready"), "w") as f:
        f.write(str(os.getpid()))
    stats = {"forwarded": 0, "dropped": 0}
    heap = []
    seq = 0
    last_poll = 0.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        now = time.monotonic()
        if now - last_poll > 0.05:  # the `link` command rewrites links.json
            last_poll = now
            try:
                m = os.stat(links_path).st_mtime_ns
                if m != links_mtime:
                    links_mtime = m
                    for link, spec in zip(links, json.load(open(links_path))):
                        link.update(spec)
                    write_json(os.path.join(sdir, "switch.stats"), stats)
            except (OSError, ValueError):
                pass
        timeout = 0.05
        if heap:
            timeout = min(timeout, max(0.0, heap[0][0] - now))
        readable, _, _ = select.select(list(by_fd), [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            for _ in range(64):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    continue  # IPv4 only
                dst = out_fd.get(pkt[16:20])
                if dst is None:
                    continue
                t = now
                src_idx, dst_idx = by_fd[fd], by_fd[dst]
                if src_idx >= 0:
                    t = links[src_idx].cross(0, len(pkt), t, now)
                if t is not None and dst_idx >= 0:
                    t = links[dst_idx].cross(1, len(pkt), t, now)
                if t is None:
                    stats["dropped"] += 1
                    continue
                seq += 1
                heapq.heappush(heap, (t, seq, dst, pkt))
        while heap and heap[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(heap)
            try:
                os.write(dst, pkt)
                stats["forwarded"] += 1
            except OSError:
                stats["dropped"] += 1


# --- commands -------------------------------------------------------------------------------

def preflight():
    if os.geteuid() != 0:
        fail(1, "needs root (network namespaces and TUN devices)")
    if not os.path.exists("/dev/net/tun"):
        fail(1, "/dev/net/tun is missing: the kernel has no TUN support")
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        fail(1, "`ip` (iproute2) is missing")


def cmd_down(args):
    sdir = state_dir(args.name)
    try:
        st = json.load(open(os.path.join(sdir, "cluster.json")))
    except (FileNotFoundError, ValueError):
        st = {"hosts": []}
    pid_path = os.path.join(sdir, "switch.pid")
    if os.path.exists(pid_path):
        try:
            os.kill(int(open(pid_path).read()), signal.SIGTERM)
        except (ValueError, ProcessLookupError):
            pass
    for host in st["hosts"]:
        ns = ns_name(args.name, host)
        pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass
        run(["ip", "netns", "del", ns], check=False)
    if os.path.isdir(sdir):
        for f in os.listdir(sdir):
            os.remove(os.path.join(sdir, f))
        os.rmdir(sdir)


def cmd_up(args):
    preflight()
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", args.name):
        fail(2, f"--name '{args.name}': 1-8 lower-case letters/digits")
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", args.subnet) or any(
            int(x) > 255 for x in args.subnet.split(".")):
        fail(2, f"--subnet '{args.subnet}': three octets, e.g. 10.77.0")
    if args.topology:
        hosts = hosts_from_topology(args.topology)
    else:
        if not 1 <= args.hosts <= 32:
            fail(2, f"--hosts {args.hosts}: 1 to 32")
        hosts = [(f"h{i}", None, None) for i in range(args.hosts)]
    cmd_down(args)
    sdir = state_dir(args.name)
    os.makedirs(sdir, exist_ok=True)
    names = [h for h, _, _ in hosts]
    write_json(os.path.join(sdir, "cluster.json"),
               {"name": args.name, "subnet": args.subnet, "hosts": names})
    links = [{"gbps": g if g is not None else args.gbps,
              "latency_us": u if u is not None else args.latency_us,
              "delay_ms": 0, "loss": 0.0, "up": True} for _, g, u in hosts]
    write_json(os.path.join(sdir, "links.json"), links)
    with open(os.path.join(sdir, "hostfile"), "w") as f:
        for h in names:
            f.write(f"{h} slots=1\n")
    for h in names:
        run(["ip", "netns", "add", ns_name(args.name, h)])
    log = open(os.path.join(sdir, "switch.log"), "w")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--name", args.name, "switch"],
                         stdout=log, stderr=log, start_new_session=True)
    with open(os.path.join(sdir, "switch.pid"), "w") as f:
        f.write(str(p.pid))
    deadline = time.monotonic() + 10
    while not os.path.exists(os.path.join(sdir, "switch.ready")):
        if p.poll() is not None or time.monotonic() > deadline:
            log.flush()
            fail(1, "the switch did not start: " + open(os.path.join(sdir, "switch.log")).read())
        time.sleep(0.05)
    for i, h in enumerate(names):
        ns = ns_name(args.name, h)
        run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{args.subnet}.{10 + i}/24", "dev",
             "pdsim0"])
        run(["ip", "netns", "exec", ns, "ip", "link", "set", "pdsim0", "mtu", str(MTU), "up"])
    sw = f"{args.name}-sw"
    run(["ip", "addr", "add", f"{args.subnet}.1/24", "dev", sw])
    run(["ip", "link", "set", sw, "mtu", str(MTU), "up"])
    print(f"cluster {args.name}: hosts {' '.join(f'{h}={args.subnet}.{10 + i}' for i, h in enumerate(names))}"
          f"; switch {args.subnet}.1 (pid {p.pid}); hostfile {os.path.join(sdir, 'hostfile')}")


def host_index(st, host):
    if host not in st["hosts"]:
        fail(2, f"host '{host}' is not in the cluster (hosts: {', '.join(st['hosts'])})")
    return st["hosts"].index(host)


def cmd_link(args):
    st = load_state(args.name)
    i = host_index(st, args.host)
    path = os.path.join(state_dir(args.name), "links.json")
    links = json.load(open(path))
    if args.delay_ms is not None:
        if not 0 <= args.delay_ms <= 60000:
            fail(2, f"--delay-ms {args.delay_ms}: 0 to 60000")
        links[i]["delay_ms"] = args.delay_ms
    if args.loss is not None:
        if not 0 <= args.loss <= 1:
            fail(2, f"--loss {args.loss}: a probability, 0 to 1")
        links[i]["loss"] = args.loss
    if args.gbps is not None:
        if not args.gbps >= 0:
            fail(2, f"--gbps {args.gbps}: >= 0 (0: unlimited)")
        links[i]["gbps"] = args.gbps
    if args.down:
        links[i]["up"] = False
    if args.up:
        links[i]["up"] = True
    write_json(path, links)
    time.sleep(0.1)  # the switch polls every 50 ms
    print(f"{args.host}: {json.dumps(links[i])}")


def cmd_kill(args):
    st = load_state(args.name)
    host_index(st, args.host)
    pids = run(["ip", "netns", "pids", ns_name(args.name, args.host)]).stdout.split()
    if args.match:
        # Only the processes whose command line holds the text (the application, not mpirun's
        # daemon): an application crash rather than the loss of the host.
        def cmdline(p):
            try:
                return open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                return ""
        pids = [p for p in pids if args.match in cmdline(p)]
    for p in pids:
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass
    print(f"{args.host}: killed {len(pids)} process(es)")


def cmd_exec(args):
    st = load_state(args.name)
    host_index(st, args.host)
    if not args.cmd:
        fail(2, "exec: no command")
    # OpenMPI's rsh launcher passes the remote command as one string (as ssh would).
    script = " ".join(args.cmd)
    os.execvp("ip", ["ip", "netns", "exec", ns_name(args.name, args.host), "unshare", "--uts",
                     "sh", "-c", f"hostname {args.host}; {script}"])


def cmd_mpirun_args(args):
    st = load_state(args.name)
    sdir = state_dir(args.name)
    agent = f"{os.path.abspath(__file__)} --name {args.name} exec"
    net = f"{st['subnet']}.0/24"
    # TCP keepalive on mpirun's links to its daemons: a host that went away (link down, killed)
    # is noticed in about 5 s and the job ends, instead of after the 300 s default.
    print(f"--hostfile {os.path.join(sdir, 'hostfile')} --mca plm_rsh_agent '{agent}' "
          f"--mca oob_tcp_if_include {net} --mca btl_tcp_if_include {net} "
          f"--mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 "
          f"--mca oob_tcp_keepalive_probes 3")


def cmd_status(args):
    st = load_state(args.name)
    sdir = state_dir(args.name)
    links = json.load(open(os.path.join(sdir, "links.json")))
    pid = open(os.path.join(sdir, "switch.pid")).read()
    alive = os.path.exists(f"/proc/{pid}")
    print(f"cluster {args.name}: switch pid {pid} ({'running' if alive else 'DEAD'})")
    for i, (h, link) in enumerate(zip(st["hosts"], links)):
        print(f"  {h} {st['subnet']}.{10 + i}: {json.dumps(link)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--name", default=os.environ.get("PDSIM_NETNS_NAME", "pdsim"),
                    help="cluster name: prefixes the namespaces (default pdsim)")
    sub = ap.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make the cluster")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--topology", help="the hosts and link rates of this topology's nodes")
    up.add_argument("--subnet", default="10.77.0")
    up.add_argument("--gbps", type=float, default=1.25, help="link rate, GB/s (0: unlimited)")
    up.add_argument("--latency-us", type=float, default=50.0, help="link one-way latency")
    sub.add_parser("down", help="remove the cluster and kill what runs in it")
    link = sub.add_parser("link", help="change a host's link")
    link.add_argument("host")
    link.add_argument("--delay-ms", type=float, help="extra one-way delay on the link")
    link.add_argument("--loss", type=float, help="packet loss probability per crossing")
    link.add_argument("--gbps", type=float)
    g = link.add_mutually_exclusive_group()
    g.add_argument("--down", action="store_true")
    g.add_argument("--up", action="store_true")
    kill = sub.add_parser("kill", help="kill -9 every process of a host")
    kill.add_argument("host")
    kill.add_argument("--match", help="only processes whose command line contains this text")
    ex = sub.add_parser("exec", help="run a command in a host")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("mpirun-args", help="print mpirun's options for this cluster")
    sub.add_parser("status")
    sw = sub.add_parser("switch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.command == "switch":
        switch_main(args.name)
        return
    {"up": cmd_up, "down": cmd_down, "link": cmd_link, "kill": cmd_kill, "exec": cmd_exec,
     "mpirun-args": cmd_mpirun_args, "status": cmd_status}[args.command](args)


if __name__ == "__main__":
    main()
