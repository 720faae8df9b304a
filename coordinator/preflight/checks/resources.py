"""Check `resources`: memory fit, checkpoint disk space, sleep/battery, and the Metal watchdog risk."""

from __future__ import annotations

import math
from typing import Any

from coordinator.facts.model import NodeFacts
from coordinator.facts.probe import shell_path
from coordinator.models import CheckResult, Node, Status
from coordinator.planning.estimate import (
    checkpoint_bytes,
    estimate_training_memory,
    model_shape,
    usable_memory,
)
from coordinator.preflight.checks.context import CheckContext, fact_error_result
from coordinator.units import format_bytes, format_count

WATCHDOG_PARAMS = 4_000_000_000


def _gb(n: int) -> str:
    return format_bytes(n)


def check_resources(ctx: CheckContext, node: Node, facts: NodeFacts) -> CheckResult:
    total = (facts.memory.total_bytes if facts.memory else None) or (
        facts.hardware.memory_bytes if facts.hardware else None)
    if total is None:
        return fact_error_result("resources", node.name,
                                 facts.errors_for("sysctl", "system_profiler", "meminfo", "vm_stat"), "memory size")
    is_mac = facts.os is not None and facts.os.is_macos
    fails: list[str] = []
    warns: list[str] = []
    remedies: list[str] = []
    evidence: dict[str, Any] = {"memory_total": total}
    # On an NVIDIA node mlx trains in the GPU's own memory (one rank per node: mlx.launch gives each rank
    # CUDA_VISIBLE_DEVICES=0), not in host RAM: the budget is that GPU's memory.
    gpu = facts.gpu.devices[0] if facts.gpu is not None and facts.gpu.cuda else None
    budget, where = total, "memory"
    # A rank inherits its SSH session's cgroup: on Linux a memory limit below RAM is what it can use.
    cgroup = facts.cgroup_memory.limit_bytes if facts.cgroup_memory is not None and not is_mac else None
    if cgroup is not None and cgroup < total:
        budget, where = cgroup, f"memory (cgroup {facts.cgroup_memory.path if facts.cgroup_memory else ''} limit)"
        evidence["cgroup_memory_limit"] = cgroup
    if gpu is not None and gpu.memory_total_bytes:
        budget, where = gpu.memory_total_bytes, f"GPU memory ({gpu.name})"
        evidence.update({"gpu": gpu.name, "gpu_memory_total": gpu.memory_total_bytes,
                         "gpu_memory_used": gpu.memory_used_bytes})
        if gpu.memory_used_bytes and gpu.memory_used_bytes > 0.1 * gpu.memory_total_bytes:
            warns.append(f"{_gb(gpu.memory_used_bytes)} of GPU {gpu.index}'s {_gb(gpu.memory_total_bytes)} already "
                         "in use by other processes")
            remedies.append("stop what holds the GPU (`nvidia-smi` lists the processes)")
    pb = ctx.playbook
    shape = model_shape(facts.model_config, facts.model_params)
    if pb is not None and pb.kind == "train" and shape is not None:
        t = pb.train
        per_rank = max(1, math.ceil(t.batch_size / max(1, len(ctx.nodes))))
        est = estimate_training_memory(
            shape, method=t.fine_tune_type, batch_per_rank=per_rank * t.rows_per_example, seq_len=t.max_seq_length,
            layers_trained=t.num_layers, grad_checkpoint=t.grad_checkpoint, with_reference=t.method == "dpo",
            fused_attention=is_mac or gpu is not None, lora_rank=t.lora.rank,
        )
        usable = usable_memory(budget, is_macos=is_mac)
        evidence.update({"params": shape.params, "estimate": est.total, "usable": usable,
                         "breakdown": {"weights": est.weights, "grads": est.grads, "optimizer": est.optimizer,
                                       "activations": est.activations, "reference": est.reference},
                         "batch_per_rank": per_rank})
        need = f"~{_gb(est.total)} needed ({format_count(shape.params)} params, {t.method}, batch {per_rank}/rank, " \
               f"seq {t.max_seq_length}) of {_gb(usable)} usable" + (f" {where}" if gpu is not None else "")
        stage = ctx.pipeline_stages.get(node.name)
        if est.total > usable and stage is not None:
            # The strategy trains as a pipeline (docs/strategy.md): this node holds its stage, not a replica.
            evidence["pipeline_stage"] = {"first_layer": stage.first_layer, "last_layer": stage.last_layer,
                                          "need": stage.need, "budget": stage.budget}
            evidence["fit"] = (f"a replica needs {need}; as pipeline stage of blocks {stage.first_layer}-"
                               f"{stage.last_layer - 1} ~{_gb(stage.need)} of {_gb(stage.budget)}")
        elif est.total > usable and node.name in ctx.left_out_by_strategy:
            # The strategy trains on the nodes that hold a replica (lint `strategy`): this one sits the run out.
            warns.append(f"{need}: left out of the run by train.strategy {t.strategy} (see the strategy finding)")
            remedies.append("use LoRA, grad_checkpoint: true or a smaller batch to train on this node too")
        elif est.total > usable:
            fails.append(need)
            remedies.append("use LoRA, grad_checkpoint: true, a smaller batch_size or max_seq_length, or a node with "
                            "more memory (calibration will cap this node's share)")
        elif est.total > 0.85 * usable:
            warns.append(need + " (little headroom)")
            remedies.append("enable grad_checkpoint or lower the batch size for headroom")
        else:
            evidence["fit"] = need
        if t.fine_tune_type == "full" and shape.params >= WATCHDOG_PARAMS and is_mac and facts.hardware is not None \
                and not facts.hardware.is_ultra:
            warns.append(f"full fine-tune of {shape.params / 1e9:.1f}B params on {facts.hardware.chip}: long Metal "
                         "command buffers can hit the GPU watchdog timeout")
            remedies.append("run full fine-tunes of >= 4B models on an Ultra, or use LoRA / a smaller per-rank batch")
        # The newest `keep_checkpoints` plus the one being written exist at once.
        ckpt = checkpoint_bytes(shape, method=t.fine_tune_type, layers_trained=t.num_layers) * (t.keep_checkpoints + 1)
        evidence["checkpoint_space"] = ckpt
        if facts.disk is not None:
            evidence["disk_free"] = facts.disk.available_bytes
            if facts.disk.available_bytes < ckpt:
                fails.append(f"{_gb(facts.disk.available_bytes)} free under {facts.disk.path}, checkpoints need "
                             f"{_gb(ckpt)}")
                remedies.append(f"free disk space on {facts.disk.mount} or point `workdir` at a larger volume")
            elif facts.disk.available_bytes < 2 * ckpt:
                warns.append(f"only {_gb(facts.disk.available_bytes)} free under {facts.disk.path} "
                             f"(checkpoints need {_gb(ckpt)})")
                remedies.append("free disk space before a long run")
    elif pb is not None and pb.kind == "train":
        evidence["estimate"] = None
        warns.append("model size unknown (no readable config.json): memory fit not estimated")
        remedies.append("check the model dir holds config.json and *.safetensors")
    if facts.disk is None:
        warns.append("free disk unknown")
        remedies.append(f"check that `df -k {shell_path(node.workdir)}` works on the node (see `coordinator facts` errors)")
    if facts.power is not None:
        p = facts.power
        evidence["power"] = {"sleep_minutes": p.sleep_minutes, "on_battery": p.on_battery,
                             "battery_percent": p.battery_percent}
        if p.sleep_minutes:
            prevented = f" (now prevented by {', '.join(p.sleep_prevented_by)})" if p.sleep_prevented_by else ""
            warns.append(f"system sleep after {p.sleep_minutes} min{prevented}: a sleeping Mac freezes the ring")
            remedies.append("`sudo pmset -a sleep 0` (or run under `caffeinate -dimsu`)")
        if p.on_battery:
            warns.append(f"on battery ({p.battery_percent}%)" if p.battery_percent is not None else "on battery")
            remedies.append("plug the Mac into AC power")
    if fails:
        return CheckResult("resources", node.name, Status.FAIL, "; ".join(fails + warns), "; ".join(remedies), evidence)
    if warns:
        return CheckResult("resources", node.name, Status.WARN, "; ".join(warns), "; ".join(remedies), evidence)
    fit = evidence.get("fit", f"{_gb(budget)} {where}")
    disk = f", {_gb(facts.disk.available_bytes)} free disk" if facts.disk else ""
    return CheckResult("resources", node.name, Status.PASS, f"{fit}{disk}", evidence=evidence)
