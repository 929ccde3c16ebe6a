"""ddpk-train: the training loop every rank runs.

Read top to bottom: flags, place, data and model (all bad input is caught
before any rank rendezvouses), process group, resume, then a flat loop.
Distributed parts are few and named: the DDP wrap, no_sync on accumulation
micro-steps, one all-reduce of the epoch's sums, rank 0 writing files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
import traceback
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, config, data, distributed, launch, models, sync_bn
from .errors import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR, UserError

LOG_EVERY_S = 5.0


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of --lr at optimizer step `step` (0-based) of `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 1.0


def rng_state(device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])


def evaluate(model: nn.Module, batches: data.Batches, place: distributed.Place, autocast) -> tuple[float, float]:
    """Loss and accuracy over the whole test split; each sample counted once, one all-reduce."""
    model.eval()
    sums = torch.zeros(3, device=place.device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in batches.test():
            with autocast():
                out = model(x)
            sums[0] += F.cross_entropy(out.float(), y, reduction="sum")
            sums[1] += (out.argmax(1) == y).sum()
            sums[2] += y.numel()
    distributed.all_reduce_sum(place, sums)
    loss, correct, count = sums.tolist()
    return loss / max(count, 1), correct / max(count, 1)


def run(argv: Sequence[str], environ) -> int:
    rank, _, world = distributed.ranks_from_env(environ)
    args = config.parse(argv, environ, world, rank)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    place = distributed.place(environ, args.device, args.backend)
    main = place.is_main
    log = (lambda msg: print(f"ddpk-train: {msg}", flush=True)) if main else (lambda msg: None)

    # Everything that can reject input happens before the rendezvous.
    ds = data.load(args.dataset, args.data_dir, args.download, args.image_size, place.device)
    torch.manual_seed(args.seed)  # one seed for model init on every rank
    model = models.build(args.model, ds.num_classes)
    resumed, resumed_from = None, None
    if main and args.checkpoint_dir:
        checkpoint.sweep_temporaries(args.checkpoint_dir)
    if main and args.resume == "auto" and args.checkpoint_dir:
        resumed, resumed_from = checkpoint.load_latest(args.checkpoint_dir)
    elif main and args.resume not in ("auto", "none"):
        try:
            resumed, resumed_from = checkpoint.load(args.resume), args.resume
        except checkpoint.CheckpointError as err:
            raise UserError(f"--resume: {err}") from None

    rdzv_t0 = time.time()
    launch.wait_at_gate(environ)  # on a non-master node: until the launcher has seen the master's port
    distributed.init(place, args.timeout)  # returns once every rank has joined: the rendezvous
    rendezvous_s = time.time() - rdzv_t0
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed * 1000 + rank)  # per-rank streams for anything random after init

    model.to(place.device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.sync_bn and place.distributed:
        model = sync_bn.convert(model, place.device.type)
    if args.strategy == "dp":
        wrapped: nn.Module = nn.DataParallel(model)
    elif place.distributed:
        wrapped = DDP(model, device_ids=[place.device] if place.device.type == "cuda" else None)
    else:
        wrapped = model
    net = torch.compile(wrapped) if args.compile else wrapped

    workers = min(8, max(1, (os.cpu_count() or 1) // int(environ.get("LOCAL_WORLD_SIZE") or 1)))
    batches = data.Batches(ds, args.batch_size, rank, world, args.seed, place.device, args.channels_last, workers)
    micro_per_epoch = batches.micro_batches_per_epoch()
    steps_per_epoch = math.ceil(micro_per_epoch / args.grad_accum)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    warmup = round(args.warmup_epochs * steps_per_epoch)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=args.momentum > 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, args.lr_schedule))
    scaler = torch.amp.GradScaler(place.device.type, enabled=args.amp == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = lambda: torch.autocast(place.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)  # noqa: E731
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    position = {"world_size": world, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                "dataset": args.dataset, "seed": args.seed}

    # Resume: rank 0 read the checkpoint; every rank gets the same copy (no shared volume needed).
    epoch0, step0, global_step = 0, 0, 0
    resumed = distributed.broadcast_object(place, resumed)
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        scaler.load_state_dict(resumed["scaler"])
        epoch0, step0, global_step = resumed["epoch"], resumed["step_in_epoch"], resumed["global_step"]
        if resumed["position"] != position and step0:
            log(f"warning: data layout changed since the checkpoint ({resumed['position']} -> {position}); "
                f"epoch {epoch0} restarts from its first batch")
            step0 = 0
        if len(resumed["rng"]) == world:
            set_rng_state(resumed["rng"][rank], place.device)
        log(f"resumed from {resumed_from} at epoch {epoch0} step_in_epoch {step0} global_step {global_step}")

    def save(epoch: int, step_in_epoch: int) -> None:
        rngs = distributed.gather_objects(place, rng_state(place.device))  # collective: every rank calls it
        if not (main and args.checkpoint_dir):
            return
        state = {
            "format": checkpoint.FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
            "step_in_epoch": step_in_epoch, "global_step": global_step, "rng": rngs, "position": position,
            "args": dict(vars(args)),
        }
        checkpoint.save(state, args.checkpoint_dir, global_step, args.keep_checkpoints)

    def write_metrics(record: dict[str, Any]) -> None:
        if main and args.metrics_file:
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    n_params = sum(p.numel() for p in model.parameters())
    log(f"world_size={world} device={place.device} backend={place.backend if place.distributed else 'none'} "
        f"model={args.model} params={n_params} dataset={args.dataset} train={len(ds.train)} test={len(ds.test)} "
        f"batch={args.batch_size}x{world}x{args.grad_accum} steps_per_epoch={steps_per_epoch} total_steps={total_steps} "
        f"rendezvous_s={rendezvous_s:.2f}")

    start = time.time()
    run_samples, run_t0, run_step0, train_s = 0, time.time(), global_step, 0.0
    last_log, log_samples = time.time(), 0
    eval_loss = eval_acc = None
    done = global_step >= total_steps
    for epoch in range(epoch0, args.epochs):
        if done:
            break
        first = step0 * args.grad_accum if epoch == epoch0 else 0
        step_in_epoch = step0 if epoch == epoch0 else 0
        stream = batches.train(epoch, first)
        micro_left = micro_per_epoch - first
        sums = torch.zeros(2, device=place.device, dtype=torch.float64)  # loss*n, n: no host sync per step
        epoch_t0, epoch_samples = time.time(), 0
        net.train()
        while micro_left > 0 and not done:
            n_micro = min(args.grad_accum, micro_left)
            for k in range(n_micro):
                x, y = next(stream)
                skip_sync = k < n_micro - 1 and isinstance(wrapped, DDP)
                with wrapped.no_sync() if skip_sync else contextlib.nullcontext():
                    with autocast():
                        loss = criterion(net(x), y)
                    scaler.scale(loss / n_micro).backward()
                sums[0] += loss.detach().double() * y.shape[0]
                sums[1] += y.shape[0]
                epoch_samples += y.shape[0]
            micro_left -= n_micro
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            global_step += 1
            step_in_epoch += 1
            done = global_step >= total_steps
            if main and time.time() - last_log >= LOG_EVERY_S:
                now = time.time()
                rate = (run_samples + epoch_samples - log_samples) * world / (now - last_log)
                eta = (now - run_t0) / (global_step - run_step0) * (total_steps - global_step)
                log(f"epoch {epoch + 1}/{args.epochs} step {global_step}/{total_steps} loss {loss.item():.4f} "
                    f"samples/s {rate:.0f} eta {eta:.0f}s")
                last_log, log_samples = now, run_samples + epoch_samples
            if args.checkpoint_every and global_step % args.checkpoint_every == 0 and micro_left > 0 and not done:
                save(epoch, step_in_epoch)
        run_samples += epoch_samples
        epoch_time = time.time() - epoch_t0
        train_s += epoch_time
        finished = micro_left == 0
        distributed.all_reduce_sum(place, sums)
        train_loss = (sums[0] / sums[1].clamp(min=1)).item()
        local_counts = torch.tensor([epoch_samples], device=place.device, dtype=torch.float64)
        global_samples = distributed.all_reduce_sum(place, local_counts).item()
        if done or (finished and ((epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs)):
            eval_loss, eval_acc = evaluate(model, batches, place, autocast)
        else:
            eval_loss = eval_acc = None
        write_metrics({
            "epoch": epoch + 1 if finished else epoch + step_in_epoch / steps_per_epoch, "step": global_step,
            "train_loss": train_loss, "eval_loss": eval_loss, "eval_acc": eval_acc,
            "samples_per_sec": global_samples / max(epoch_time, 1e-9), "world_size": world,
            "elapsed_s": round(time.time() - start, 3),
        })
        log(f"epoch {epoch + 1}/{args.epochs} step {global_step} train_loss {train_loss:.4f}"
            + (f" eval_loss {eval_loss:.4f} eval_acc {eval_acc:.4f}" if eval_acc is not None else ""))
        if finished:
            save(epoch + 1, 0)
        else:
            save(epoch, step_in_epoch)

    if eval_acc is None:
        eval_loss, eval_acc = evaluate(model, batches, place, autocast)
    elapsed = time.time() - start
    rate = run_samples * world / max(train_s, 1e-9)  # training only: evaluation is not throughput
    log(f"done steps={global_step} world_size={world} elapsed_s={elapsed:.1f} samples_per_sec={rate:.0f} "
        f"eval_loss={eval_loss:.4f} eval_acc={eval_acc:.4f}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    speaks = os.environ.get("LOCAL_RANK", "0") == "0"  # one line per node, not one per rank
    try:
        code = run(argv, os.environ)
    except UserError as err:
        if speaks:
            print(f"ddpk-train: {err}", file=sys.stderr, flush=True)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:
        code = 130
    except Exception as err:
        rank = os.environ.get("RANK", "0")
        if distributed.collective_failed(err, distributed.group_up()):
            print(f"ddpk-train: rank {rank}: collective failed: {str(err).splitlines()[0]}", file=sys.stderr)
        else:
            traceback.print_exc()
        code = EXIT_FAILED
    if distributed.group_up():
        # Never tear a process group down at exit. With a peer gone it can block; even after a clean
        # run gloo can deadlock: the main thread frees DDP's reducer and joins gloo's worker threads
        # while holding the GIL, and a worker needs the GIL to free a finished collective's tensor.
        # Checkpoints are fsynced and metrics closed by now, so leave without teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
