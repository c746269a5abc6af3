#!/usr/bin/env python3
"""Generate pdsim topology YAML for the clusters people have (Python 3 standard library only).

    gen_topology.py dgx-h100 --nodes 2 --pd 1:1 --tp 8 --model llama3-70b > dgx.yaml
    gen_topology.py dgx-h200 --nodes 4 --pd 3:1 --tp 8 --out dgx-h200.yaml
    gen_topology.py gb200-nvl72 --pd 8:4 --prefill-tp 4 --decode-tp 8 --model deepseek-v3
    gen_topology.py cpu --pd 1:1            # this machine: one cpu device per MPI rank
    gen_topology.py gpu --gpu H200 --gpus 1 --colocated 1   # one GPU box, one colocated instance
    gen_topology.py gpu --gpu H200 --gpus 1 --pd 1:1 --share-gpus  # prefill and decode on GPU 0
    gen_topology.py gpu --gpus 1 --pd 1:1 --prefill-tp 2 --share-gpus --model tiny  # TP 2 on GPU 0

Clusters: dgx-a100, dgx-h100, dgx-h200, dgx-b200 (N nodes of 8 GPUs, NVSwitch, 8 NICs of
400 Gb/s -- 200 Gb/s for A100 -- on one InfiniBand fabric), gb200-nvl72 (racks of 18 trays x 4
GB200 on one NVLink domain per rack), cpu (one node, this machine), gpu (one host with --gpus
GPUs of type --gpu on a PCIe switch; --colocated N makes N colocated instances instead of --pd;
--share-gpus places prefill and decode instances each from GPU 0, so that they share GPUs, which
are marked `shared: true`; there an instance wider than the host wraps around its GPUs, so that a
one-GPU box runs TP 2 as two ranks on GPU 0).

The output is the same topology the C++ builders make (topology/builders.h): same ids, links,
numbers and placement; tests/topology_test.cpp checks that. Validate it with
`pdsim topology validate FILE`. File format: topology/README.md. Units: gbps is GB/s
(10^9 bytes per second, per direction), latency_us is microseconds.
"""

import argparse
import json
import os
import shlex
import sys

# name: (bf16 TFLOP/s, NVLink GB/s per direction, PCIe GB/s per direction); see gpu_spec.h.
GPUS = {
    "A100": (312.0, 300.0, 32.0),
    "H100": (989.0, 450.0, 64.0),
    "H200": (989.0, 450.0, 64.0),
    "B200": (2250.0, 900.0, 64.0),
    "GB200": (2500.0, 900.0, 64.0),
}
HOP_NVLINK_US = 0.5
HOP_PCIE_US = 0.5
HOP_IB_US = 1.0
DGX_GPUS = 8
TRAY_GPUS = 4
TRAYS_PER_RACK = 18
MODELS = ["tiny", "hybrid-tiny", "llama3-8b", "llama3-70b", "deepseek-v3"]
# (gpu, cluster, path): GPU->GPU path of the builders' clusters, for the cpu `shaping` section.
PRESETS = ["dgx-a100-ib", "dgx-a100-nvlink", "dgx-h100-ib", "dgx-h100-nvlink", "dgx-h200-ib",
           "dgx-h200-nvlink", "dgx-b200-ib", "dgx-b200-nvlink", "gb200-nvl72-nvlink",
           "gb200-nvl72-ib"]


class GenError(Exception):
    pass


def num(v):
    """50.0 -> '50', 0.5 -> '0.5'."""
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def q(s):
    """A YAML double-quoted string (JSON escaping is valid YAML)."""
    return json.dumps(s)


def place(gpus, domain, prefill, decode, ptp, dtp, colocated=0, ctp=1, wrap=False):
    """Prefill, then decode, then colocated instances take GPUs in order; never straddle a domain
    unless tp is a multiple of it (then start on a boundary). With wrap (shared GPUs), an instance
    wider than all the GPUs puts TP rank i on GPU i % len(gpus) and must be its role's only one.
    Same rule as topology/builders.cpp."""
    out = []
    cursor = 0
    for role, count, tp in (("prefill", prefill, ptp), ("decode", decode, dtp),
                            ("colocated", colocated, ctp)):
        if wrap and count > 0 and tp > len(gpus):
            if count > 1:
                raise GenError(f"{count} {role} instances at TP {tp} on {len(gpus)} shared GPUs: "
                               f"an instance wider than the host wraps around its GPUs and must "
                               f"be its role's only one")
            out.append({"id": f"{role}0", "role": role, "tp": tp,
                        "devices": [gpus[i % len(gpus)] for i in range(tp)]})
            continue
        for k in range(count):
            if tp <= domain:
                if cursor % domain + tp > domain:
                    cursor = (cursor // domain + 1) * domain
            else:
                if tp % domain != 0:
                    raise GenError(f"{role} TP {tp} spans NVLink domains of {domain} GPUs but is "
                                   f"not a multiple of {domain}")
                cursor = (cursor + domain - 1) // domain * domain
            if cursor + tp > len(gpus):
                if colocated:
                    raise GenError(f"{colocated} colocated instances at TP {ctp} do not fit on "
                                   f"{len(gpus)} GPUs")
                raise GenError(f"{prefill}:{decode} instances at TP {ptp}:{dtp} do not fit on "
                               f"{len(gpus)} GPUs (instances do not straddle {domain}-GPU NVLink "
                               f"domains)")
            out.append({"id": f"{role}{k}", "role": role, "tp": tp,
                        "devices": gpus[cursor:cursor + tp]})
            cursor += tp
    return out


def gpu_tray(node_id, hostname, cpus, gpu, gpus, nic_gbps, nvswitch, node_switch):
    _, nvlink, pcie = GPUS[gpu]
    node = {"id": node_id, "hostname": hostname, "cpus": cpus,
            "devices": [{"id": f"{node_id}.gpu{j}", "type": gpu, "index": j} for j in range(gpus)],
            "nics": [{"id": f"{node_id}.nic{j}", "type": "ib", "gbps": nic_gbps}
                     for j in range(gpus)],
            "switches": [{"id": nvswitch, "type": "nvlink"}] if node_switch else []}
    links = []
    for j in range(gpus):
        g, nic = f"{node_id}.gpu{j}", f"{node_id}.nic{j}"
        links.append((g, nvswitch, "nvlink", nvlink, HOP_NVLINK_US))
        links.append((g, nic, "pcie", pcie, HOP_PCIE_US))
        links.append((nic, "ib-fabric", "ib", nic_gbps, HOP_IB_US))
    return node, links


def default_name(cluster, count, unit, a):
    n = f"{cluster}-{count}{unit}-{a.prefill}p{a.decode}d-tp{a.prefill_tp}"
    if a.decode_tp != a.prefill_tp:
        n += f"-tp{a.decode_tp}"
    return n


def hostnames(a):
    return [h for h in a.hosts.split(",") if h] if a.hosts else []


def make_dgx(gpu, a):
    if a.nodes < 1:
        raise GenError("--nodes must be >= 1")
    a100 = gpu == "A100"
    nic_gbps = 25.0 if a100 else 50.0
    cpus = 128 if a100 else 112
    cluster = "dgx-" + gpu.lower()
    hosts = hostnames(a)
    t = {"name": a.name or default_name(cluster, a.nodes, "node", a),
         "description": f"{a.nodes} DGX {gpu} node{'' if a.nodes == 1 else 's'}: 8x {gpu} each, "
                        f"NVSwitch, 8x {200 if a100 else 400} Gb/s InfiniBand",
         "nodes": [], "switches": [{"id": "ib-fabric", "type": "ib"}], "links": []}
    gpus = []
    for i in range(a.nodes):
        nid = f"n{i}"
        node, links = gpu_tray(nid, hosts[i] if i < len(hosts) else nid, cpus, gpu, DGX_GPUS,
                               nic_gbps, f"{nid}.nvswitch", True)
        t["nodes"].append(node)
        t["links"].append((f"node {nid}", links))
        gpus += [f"{nid}.gpu{j}" for j in range(DGX_GPUS)]
    t["instances"] = place(gpus, DGX_GPUS, a.prefill, a.decode, a.prefill_tp, a.decode_tp)
    return t


def make_gb200(a):
    if a.racks < 1:
        raise GenError("--racks must be >= 1")
    hosts = hostnames(a)
    t = {"name": a.name or default_name("gb200-nvl72", a.racks, "rack", a),
         "description": f"{a.racks} GB200 NVL72 rack{'' if a.racks == 1 else 's'}: 18 trays of 4 "
                        f"GB200 on one NVLink domain per rack, 4x 400 Gb/s InfiniBand per tray",
         "nodes": [], "links": []}
    gpus = []
    for r in range(a.racks):
        for k in range(TRAYS_PER_RACK):
            tray = r * TRAYS_PER_RACK + k
            nid = f"t{tray}"
            node, links = gpu_tray(nid, hosts[tray] if tray < len(hosts) else nid, 144, "GB200",
                                   TRAY_GPUS, 50.0, f"rack{r}.nvswitch", False)
            t["nodes"].append(node)
            t["links"].append((f"tray {nid} (rack {r})", links))
            gpus += [f"{nid}.gpu{j}" for j in range(TRAY_GPUS)]
    t["switches"] = [{"id": f"rack{r}.nvswitch", "type": "nvlink"} for r in range(a.racks)]
    t["switches"].append({"id": "ib-fabric", "type": "ib"})
    t["instances"] = place(gpus, TRAY_GPUS * TRAYS_PER_RACK, a.prefill, a.decode, a.prefill_tp,
                           a.decode_tp)
    return t


def preset(name):
    """The GPU->GPU path of a builder cluster: same numbers as emulation_preset() in C++."""
    if name not in PRESETS:
        raise GenError(f"unknown --emulate {name!r} (none or one of: {', '.join(PRESETS)})")
    ib = name.endswith("-ib")
    cluster = name[:-3] if ib else name[:-7]
    gpu = "GB200" if cluster == "gb200-nvl72" else cluster[4:].upper()
    _, nvlink, pcie = GPUS[gpu]
    nic = 25.0 if gpu == "A100" else 50.0
    if ib:
        gbps, lat = min(pcie, nic), 2 * HOP_PCIE_US + 2 * HOP_IB_US
    else:
        gbps, lat = nvlink, 2 * HOP_NVLINK_US
    return {"emulate": f"{cluster} GPU->GPU {'across nodes (InfiniBand)' if ib else 'over NVLink'}",
            "type": "ib" if ib else "nvlink", "gbps": gbps, "latency_us": lat, "gpu": gpu}


def make_cpu(a):
    world = a.prefill * a.prefill_tp + a.decode * a.decode_tp
    name = a.name
    if not name:
        name = f"cpu-{a.prefill}p{a.decode}d"
        if a.prefill_tp != 1 or a.decode_tp != 1:
            name += f"-tp{a.prefill_tp}-to-tp{a.decode_tp}"
    cpus = (os.cpu_count() or 0) if a.cpus is None else a.cpus
    devs = [f"node0.cpu{j}" for j in range(world)]
    t = {"name": name, "description": "CPU testbed on this machine: one cpu device per MPI rank",
         "nodes": [{"id": "node0", "hostname": "localhost", "cpus": cpus,
                    "devices": [{"id": d, "type": "cpu"} for d in devs], "nics": [],
                    "switches": [{"id": "node0.shm", "type": "loopback"}]}],
         "switches": [],
         "links": [("ranks on node0 (shared memory; nominal numbers)",
                    [(d, "node0.shm", "loopback", 10.0, 1.0) for d in devs])]}
    t["instances"] = place(devs, world, a.prefill, a.decode, a.prefill_tp, a.decode_tp)
    if a.emulate != "none":
        s = preset(a.emulate)
        s["time_scale"] = a.time_scale
        t["shaping"] = s
    return t


def make_gpu(a):
    """One host, --gpus GPUs of --gpu on a PCIe switch: same as make_gpu_host() in C++."""
    if a.gpu not in GPUS:
        raise GenError(f"--gpu {a.gpu!r}: expected one of {', '.join(GPUS)}")
    if a.gpus < 1 or a.gpus > 64:
        raise GenError("--gpus must be in [1, 64]")
    _, _, pcie = GPUS[a.gpu]
    name = a.name
    if not name:
        name = f"gpu-{a.gpus}x{a.gpu.lower()}-"
        if a.colocated:
            name += f"{a.colocated}c-tp{a.colocated_tp}"
        else:
            name += f"{a.prefill}p{a.decode}d-tp{a.prefill_tp}"
            if a.decode_tp != a.prefill_tp:
                name += f"-tp{a.decode_tp}"
            if a.share_gpus:
                name += "-shared"
    devs = [f"node0.gpu{j}" for j in range(a.gpus)]
    if a.share_gpus:
        # Each role on its own from GPU 0 (as make_gpu_host() with share_gpus).
        instances = (place(devs, a.gpus, a.prefill, 0, a.prefill_tp, a.decode_tp, wrap=True)
                     + place(devs, a.gpus, 0, a.decode, a.prefill_tp, a.decode_tp, wrap=True))
    else:
        instances = place(devs, a.gpus, a.prefill, a.decode, a.prefill_tp, a.decode_tp,
                          a.colocated, a.colocated_tp)
    users = {d: sum(i["devices"].count(d) for i in instances) for d in devs}
    t = {"name": name, "description": f"one host: {a.gpus}x {a.gpu} on a PCIe switch",
         "nodes": [{"id": "node0", "hostname": "localhost", "cpus": a.cpus or 0,
                    "devices": [dict({"id": d, "type": a.gpu, "index": j},
                                     **({"shared": True} if users[d] > 1 else {}))
                                for j, d in enumerate(devs)],
                    "nics": [], "switches": [{"id": "node0.pcie", "type": "pcie"}]}],
         "switches": [],
         "links": [("GPUs on node0's PCIe switch",
                    [(d, "node0.pcie", "pcie", pcie, HOP_PCIE_US) for d in devs])]}
    t["instances"] = instances
    return t


def emit(t, model, command):
    colocated = all(i["role"] == "colocated" for i in t["instances"])
    o = [f"# Generated by: {command}",
         "# Units: gbps = GB/s (10^9 bytes per second, per direction); latency_us = microseconds.",
         "# Ranks: colocated instances in file order (no KV transfer); TP ranks consecutive."
         if colocated else
         "# Ranks: prefill instances first, then decode, each in file order; TP ranks consecutive.",
         f"name: {q(t['name'])}",
         f"description: {q(t['description'])}"]
    if model:
        o.append(f"model: {model}")
    world = sum(i["tp"] for i in t["instances"])
    o.append(f"world_size: {world}")
    o.append("nodes:")
    for n in t["nodes"]:
        o.append(f"  - id: {n['id']}")
        o.append(f"    hostname: {n['hostname']}")
        if n["cpus"]:
            o.append(f"    cpus: {n['cpus']}")
        o.append("    devices:")
        for d in n["devices"]:
            idx = f", index: {d['index']}" if "index" in d else ""
            shared = ", shared: true" if d.get("shared") else ""
            o.append(f"      - {{id: {d['id']}, type: {d['type']}{idx}{shared}}}")
        if n["nics"]:
            o.append("    nics:")
            for nic in n["nics"]:
                o.append(f"      - {{id: {nic['id']}, type: {nic['type']}, gbps: {num(nic['gbps'])}}}"
                         f"  # {num(nic['gbps'] * 8)} Gb/s")
        if n["switches"]:
            o.append("    switches:")
            for s in n["switches"]:
                o.append(f"      - {{id: {s['id']}, type: {s['type']}}}")
    if t["switches"]:
        o.append("switches:")
        for s in t["switches"]:
            o.append(f"  - {{id: {s['id']}, type: {s['type']}}}")
    o.append("links:")
    for comment, links in t["links"]:
        o.append(f"  # {comment}")
        for a, b, typ, gbps, lat in links:
            o.append(f"  - {{a: {a}, b: {b}, type: {typ}, gbps: {num(gbps)}, latency_us: {num(lat)}}}")
    o.append("instances:")
    for i in t["instances"]:
        o.append(f"  - id: {i['id']}")
        o.append(f"    role: {i['role']}")
        o.append(f"    tp: {i['tp']}")
        o.append(f"    devices: [{', '.join(i['devices'])}]")
    if "shaping" in t:
        s = t["shaping"]
        o.append("# The CPU testbed throttles its transport to this link, scaled by time_scale (CPU")
        o.append("# time / GPU time; auto = measured), to keep the GPU cluster's compute:transfer ratio.")
        o.append("shaping:")
        o.append(f"  emulate: {q(s['emulate'])}")
        o.append(f"  type: {s['type']}")
        o.append(f"  gbps: {num(s['gbps'])}")
        o.append(f"  latency_us: {num(s['latency_us'])}")
        o.append(f"  gpu: {s['gpu']}")
        o.append(f"  time_scale: {s['time_scale']}")
    return "\n".join(o) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", choices=["dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200",
                                       "gb200-nvl72", "cpu", "gpu"])
    p.add_argument("--pd", help="prefill:decode instance counts (default 1:1)")
    p.add_argument("--colocated", type=int, default=0,
                   help="gpu: this many colocated instances (each serves whole requests) "
                        "instead of --pd")
    p.add_argument("--share-gpus", action="store_true",
                   help="gpu: prefill and decode instances each take GPUs from GPU 0, sharing "
                        "them (a one-GPU machine's only prefill/decode layout)")
    p.add_argument("--gpu", default="H200", help=f"gpu: GPU type, one of {', '.join(GPUS)}")
    p.add_argument("--gpus", type=int, default=1, help="gpu: GPUs on the host (default 1)")
    p.add_argument("--tp", type=int, help="TP size of every instance")
    p.add_argument("--prefill-tp", type=int, help="TP size of prefill instances")
    p.add_argument("--decode-tp", type=int, help="TP size of decode instances")
    p.add_argument("--model", help="built-in model for the TP check, or none "
                                   "(default: llama3-70b on GPUs, tiny on cpu)")
    p.add_argument("--name", help="topology name (default: derived from the arguments)")
    p.add_argument("--hosts", help="comma-separated hostnames, one per node (default: node ids)")
    p.add_argument("--nodes", type=int, default=2, help="DGX nodes (default 2)")
    p.add_argument("--racks", type=int, default=1, help="NVL72 racks (default 1)")
    p.add_argument("--cpus", type=int, help="cpu: cores on the machine (default: this one's; "
                                            "0 = leave out); gpu: the host's (default: left out)")
    p.add_argument("--emulate", default="dgx-h100-ib",
                   help=f"cpu: link to emulate, none or one of {', '.join(PRESETS)}")
    p.add_argument("--time-scale", default="auto", help="cpu: CPU time / GPU time, or auto")
    p.add_argument("--out", help="output file (default: stdout)")
    a = p.parse_args(argv)
    if a.colocated and a.cluster != "gpu":
        p.error("--colocated: only with the gpu cluster")
    if a.share_gpus and a.cluster != "gpu":
        p.error("--share-gpus: only with the gpu cluster")
    if a.share_gpus and a.colocated:
        p.error("--share-gpus places prefill and decode instances; not with --colocated")
    if a.colocated and a.pd is not None:
        p.error("--pd and --colocated are exclusive (a topology is disaggregated or colocated)")
    if a.colocated < 0:
        p.error("--colocated must be >= 0")
    try:
        pd = (a.pd or ("0:0" if a.colocated else "1:1")).split(":")
        if len(pd) != 2:
            raise ValueError
        a.prefill, a.decode = int(pd[0]), int(pd[1])
    except (ValueError, IndexError):
        p.error(f"--pd {a.pd!r}: expected P:D, e.g. 3:1")
    default_tp = 1 if a.cluster in ("cpu", "gpu") else 8
    a.prefill_tp = a.prefill_tp or a.tp or default_tp
    a.decode_tp = a.decode_tp or a.tp or default_tp
    a.colocated_tp = a.tp or default_tp
    if a.colocated:
        if a.colocated_tp < 1:
            p.error("TP sizes must be >= 1")
    elif a.prefill < 1 or a.decode < 1 or a.prefill_tp < 1 or a.decode_tp < 1:
        p.error("instance counts and TP sizes must be >= 1")
    if a.model is None:
        a.model = "tiny" if a.cluster in ("cpu", "gpu") else "llama3-70b"
    if a.model not in MODELS + ["none"]:
        p.error(f"--model {a.model!r}: expected none or one of {', '.join(MODELS)}")
    if a.time_scale != "auto":
        try:
            if float(a.time_scale) <= 0:
                raise ValueError
        except ValueError:
            p.error(f"--time-scale {a.time_scale!r}: expected a positive number or auto")
    return a


def main(argv):
    a = parse_args(argv)
    try:
        if a.cluster.startswith("dgx-"):
            t = make_dgx(a.cluster[4:].upper(), a)
        elif a.cluster == "gb200-nvl72":
            t = make_gb200(a)
        elif a.cluster == "gpu":
            t = make_gpu(a)
        else:
            t = make_cpu(a)
    except GenError as e:
        print(f"gen_topology.py: error: {e}", file=sys.stderr)
        return 2
    args = []
    skip = False
    for x in argv:  # the command line without --out, so the header regenerates the file
        if skip:
            skip = False
            continue
        if x == "--out":
            skip = True
            continue
        if x.startswith("--out="):
            continue
        args.append(x)
    command = " ".join(["scripts/topology/gen_topology.py"] + [shlex.quote(x) for x in args])
    text = emit(t, None if a.model == "none" else a.model, command)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
