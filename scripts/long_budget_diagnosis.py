"""Why does Selective-Backprop-style selection level off at long budgets? (issue 45, item 1)

A plain PyTorch loop, apart from raysb's engine (it shares only raysb's data preparation
and model builder, as tests/reference_loop.py does), that trains the small CNN on full
Fashion-MNIST for a budget counted in backpropagated examples and records what the
candidate explanations predict:

  (a) test error at every epoch end, per-class test error at the end;
  (b) the same final model's test error after BatchNorm running statistics are rebuilt
      on the full training set (reset, momentum None, a train-mode pass under no_grad);
  (c) examples not trained on in the last k passes / k epochs' worth of steps, and the
      final model's training error and loss on them against the rest; how many times each
      example was trained;
  (d) recorded scores of the kept set against all, and each class's share of the kept set,
      per epoch;
  (e) training-set error and loss of the final model (all 60k, eval mode), and at
      checkpoints during the run (forgetting: right at a checkpoint, wrong at the end);
  (f) variants: free-sb with the last 12.5% of the budget on everything, and free-sb with
      each kept example's loss weighted s / P.

Strategies: traditional, free-sb, uniform, free-sb-anneal, free-sb-weighted.

    nice -n 5 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python \
        scripts/long_budget_diagnosis.py --strategy free-sb --seed 0 --budget 4 --out /tmp/diag

An "epoch" here is one pass over the shuffled training set: every example for traditional,
the kept ones for the selective strategies; passes continue until the budget is spent.
Kept examples wait across passes until a batch of 128 is full, so every step has 128.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from raysb.config import TrainConfig
from raysb.data.prepare import prepare_data
from raysb.models import build_model

STRATEGIES = ("traditional", "free-sb", "uniform", "free-sb-anneal", "free-sb-weighted")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def evaluate(model, x, y, batch=2000):
    """Per-example loss and correctness in eval mode."""
    model.eval()
    losses, correct = [], []
    with torch.inference_mode():
        for start in range(0, len(x), batch):
            logits = model(x[start:start + batch])
            target = y[start:start + batch]
            losses.append(F.cross_entropy(logits, target, reduction="none"))
            correct.append(logits.argmax(1) == target)
    return torch.cat(losses), torch.cat(correct)


def per_class_error(correct, y, classes=10):
    return [float(1 - correct[y == c].float().mean()) for c in range(classes)]


def recalibrate_batchnorm(model, x, batch=1000):
    """Running statistics rebuilt from the full training set: a cumulative average over all of it."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum, m.running_mean.clone(), m.running_var.clone()) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for start in range(0, len(x), batch):
            model(x[start:start + batch])
    model.eval()
    return norms, saved


def restore_batchnorm(norms, saved):
    for m, (momentum, mean, var) in zip(norms, saved):
        m.momentum = momentum
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)


def quantiles(values: torch.Tensor) -> dict:
    if values.numel() == 0:
        return {}
    q = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64)).tolist() \
        if values.numel() < 16_000_000 else []
    return {"mean": float(values.mean()), **{f"q{int(p * 100)}": v for p, v in zip(QUANTILES, q)}}


def group_stats(mask: torch.Tensor, losses: torch.Tensor, correct: torch.Tensor) -> dict:
    n = int(mask.sum())
    if n == 0:
        return {"share": 0.0, "n": 0}
    return {
        "share": n / len(mask),
        "n": n,
        "error": float(1 - correct[mask].float().mean()),
        "loss": float(losses[mask].mean()),
    }


def run(args) -> dict:
    torch.set_num_threads(1)
    config = TrainConfig(dataset="fashion-mnist", strategy="traditional", seed=args.seed, subset=args.subset)
    train_data, test_data, _ = prepare_data(config)
    torch.manual_seed(args.seed)
    model = build_model(config.model, 10, 1, 28, **config.model_options)
    mean, std = train_data.mean[0], train_data.std[0]
    x_train = (train_data.images.float() / 255 - mean) / std
    y_train = train_data.labels.clone()
    x_test = (test_data.images.float() / 255 - mean) / std
    y_test = test_data.labels.clone()
    n = len(y_train)
    classes = train_data.num_classes

    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    batch = config.batch_size
    budget = int(round(args.budget * args.base_epochs * n))  # backpropagated examples
    warmup_examples = config.lr_warmup_epochs * n
    s = args.selectivity
    beta = 1 / s - 1
    order_gen = torch.Generator().manual_seed(args.seed)
    draw_gen = torch.Generator().manual_seed(args.seed + 2)

    scores = torch.full((n,), float("nan"))  # each example's loss in its last training forward
    times_trained = torch.zeros(n, dtype=torch.int64)
    last_step = torch.full((n,), -1, dtype=torch.int64)
    last_pass = torch.full((n,), -1, dtype=torch.int64)
    waiting_idx: list[torch.Tensor] = []
    waiting_w: list[torch.Tensor] = []
    done, step, epoch = 0, 0, 0
    selective = args.strategy != "traditional"
    anneal_at = 1 - args.anneal_share if args.strategy == "free-sb-anneal" else None
    epochs_log = []
    checkpoints = [0.5, 0.75]
    next_test = args.test_every  # test error at the first pass end past each such share of the budget
    checkpoint_correct = {}
    max_weight = 0.0
    t0 = time.time()
    step_time = 0.0

    def lr_now() -> float:
        warm = min(1.0, (done + batch) / warmup_examples) if warmup_examples else 1.0
        fraction = min(1.0, (done + batch) / budget)
        return config.lr * warm * 0.5 * (1 + math.cos(math.pi * fraction))

    def train_step(index: torch.Tensor, weights: torch.Tensor | None) -> None:
        nonlocal done, step, step_time
        ts = time.time()
        lr = lr_now()
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        losses = F.cross_entropy(model(x_train[index]), y_train[index], reduction="none")
        loss = (losses * weights).mean() if weights is not None else losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scores[index] = losses.detach()
        times_trained[index] += 1
        last_step[index] = step
        last_pass[index] = epoch
        done += len(index)
        step += 1
        step_time += time.time() - ts

    saved_points: set = set()
    resume = None
    if args.resume_from:
        # Continue a run saved by --save-at (e.g. free-sb at 0.875 -> free-sb-anneal): until that point
        # the two are the same computation (same seeds, same draws), so this equals a run from scratch.
        resume = torch.load(args.resume_from, weights_only=False)
        assert resume["seed"] == args.seed and resume["budget"] == budget, "checkpoint of another run"
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scores, times_trained, last_step, last_pass = (resume["scores"], resume["times_trained"],
                                                       resume["last_step"], resume["last_pass"])
        done, step, epoch, epochs_log = resume["done"], resume["step"], resume["epoch"], resume["epochs_log"]
        checkpoint_correct, next_test = resume["checkpoint_correct"], resume["next_test"]
        order_gen.set_state(resume["order_gen"])
        draw_gen.set_state(resume["draw_gen"])
        step_time, max_weight, saved_points = resume["step_time"], resume["max_weight"], resume["saved_points"]
        t0 = time.time() - resume["elapsed"]
    while done < budget:
        if resume is not None:
            # mid-pass, at the top of the batch loop, exactly where the saving run stood
            rec, queue_idx, queue_w, pos, plain = (resume["rec"], resume["queue_idx"], resume["queue_w"],
                                                   resume["pos"], resume["plain"])
            use_weights = args.strategy == "free-sb-weighted"
            switched = False
            resume = None
        else:
            perm = torch.randperm(n, generator=order_gen)
            progress_start = done / budget
            plain = (not selective) or (anneal_at is not None and progress_start >= anneal_at)
            rec = {"epoch": epoch, "progress_start": progress_start, "plain": plain}
            frozen = scores.clone()
            recorded = frozen[~frozen.isnan()]
            if plain:
                kept = perm
                probability = torch.ones(n)
            elif args.strategy == "uniform":
                kept = perm[: int(round(s * n))]
                probability = torch.full((n,), s)
            else:
                ordered = torch.sort(recorded).values
                cdf = torch.searchsorted(ordered, frozen.nan_to_num(0.0)).double() / max(1, len(ordered))
                probability = torch.where(frozen.isnan(), torch.ones(n, dtype=torch.float64), cdf**beta).float()
                draws = torch.rand(n, generator=draw_gen)
                keep_mask = draws[perm] < probability[perm]
                kept = perm[keep_mask]
            # (d): the kept set's recorded scores against all, and its class shares
            kept_scores = frozen[kept]
            kept_scores = kept_scores[~kept_scores.isnan()]
            rec["kept"] = int(len(kept))
            rec["kept_share"] = len(kept) / n
            rec["unscored_kept"] = int(frozen[kept].isnan().sum())
            rec["score_all"] = quantiles(recorded)
            rec["score_kept"] = quantiles(kept_scores)
            counts = torch.bincount(y_train[kept], minlength=classes).double()
            rec["class_share_kept"] = (counts / counts.sum().clamp_min(1)).tolist()
            if args.strategy == "free-sb-weighted" and not plain:
                # s / P; examples kept only because they have no score yet (pass 1) weigh 1
                w_all = torch.where(frozen.isnan(), torch.ones(n), s / probability.clamp_min(1e-12))
                kept_w = w_all[kept]
                rec["weight_kept"] = quantiles(kept_w)
                max_weight = max(max_weight, float(kept_w.max()) if len(kept_w) else 0.0)
            else:
                kept_w = None
            if not plain and args.strategy != "uniform":
                rec["mean_probability_kept"] = float(probability[kept].mean())

            waiting_idx.append(kept)
            waiting_w.append(kept_w if kept_w is not None else torch.ones(len(kept)))
            queue_idx = torch.cat(waiting_idx)
            queue_w = torch.cat(waiting_w)
            use_weights = args.strategy == "free-sb-weighted"
            pos = 0
            switched = False
        while len(queue_idx) - pos >= batch and done < budget:
            for point in args.save_at:
                if point not in saved_points and done / budget >= point:
                    saved_points.add(point)
                    torch.save({
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scores": scores, "times_trained": times_trained, "last_step": last_step,
                        "last_pass": last_pass, "done": done, "step": step, "epoch": epoch,
                        "epochs_log": copy.deepcopy(epochs_log), "rec": copy.deepcopy(rec),
                        "checkpoint_correct": checkpoint_correct, "next_test": next_test,
                        "order_gen": order_gen.get_state(), "draw_gen": draw_gen.get_state(),
                        "step_time": step_time, "elapsed": time.time() - t0, "max_weight": max_weight,
                        "queue_idx": queue_idx, "queue_w": queue_w, "pos": pos, "plain": plain,
                        "saved_points": set(saved_points), "strategy": args.strategy, "seed": args.seed,
                        "budget": budget,
                    }, Path(args.out) / f"ckpt_{args.strategy}_b{args.budget:g}_s{args.seed}_p{point:g}.pt")
            if (not plain and anneal_at is not None and done / budget >= anneal_at):
                switched = True  # the rest of the budget on everything, from a fresh pass
                break
            idx = queue_idx[pos:pos + batch]
            w = queue_w[pos:pos + batch] if use_weights else None
            train_step(idx, w)
            pos += batch
            for c in checkpoints:
                if c not in checkpoint_correct and done >= c * budget:
                    _, corr = evaluate(model, x_train, y_train)
                    checkpoint_correct[c] = corr.clone()
        if switched:
            waiting_idx[:] = []
            waiting_w[:] = []
        else:
            waiting_idx[:] = [queue_idx[pos:]]
            waiting_w[:] = [queue_w[pos:]]
        rec.update({"progress_end": done / budget, "steps": step, "lr_end": lr_now()})
        if done / budget >= next_test - 1e-9 or done >= budget:
            test_loss, test_correct = evaluate(model, x_test, y_test)
            rec["test_error"] = float(1 - test_correct.float().mean())
            rec["test_loss"] = float(test_loss.mean())
            while next_test <= done / budget + 1e-9:
                next_test += args.test_every
        rec["seconds"] = time.time() - t0
        epochs_log.append(rec)
        test = f"test {100 * rec['test_error']:.2f}% " if "test_error" in rec else ""
        print(f"[{args.strategy} s{args.seed}] pass {epoch} progress {rec['progress_end']:.3f} kept {rec['kept']} "
              f"{test}lr {rec['lr_end']:.4f} ({rec['seconds']:.0f}s)", flush=True)
        epoch += 1

    # ---- expensive measurements on the final model ----
    result = {"strategy": args.strategy, "seed": args.seed, "budget_multiple": args.budget,
              "budget_examples": budget, "steps": step, "passes": epoch,
              "train_seconds": step_time, "seconds": time.time() - t0,
              "resumed_from": args.resume_from, "selectivity": s, "beta": beta, "anneal_share": args.anneal_share if anneal_at else None,
              "max_weight": max_weight if args.strategy == "free-sb-weighted" else None}
    test_loss, test_correct = evaluate(model, x_test, y_test)
    result["test_error"] = float(1 - test_correct.float().mean())
    result["test_loss"] = float(test_loss.mean())
    result["test_class_error"] = per_class_error(test_correct, y_test, classes)
    train_loss, train_correct = evaluate(model, x_train, y_train)
    result["train_error"] = float(1 - train_correct.float().mean())
    result["train_loss"] = float(train_loss.mean())
    result["train_class_error"] = per_class_error(train_correct, y_train, classes)

    # (b) BatchNorm statistics rebuilt on all 60k
    norms, saved = recalibrate_batchnorm(model, x_train)
    bn_test_loss, bn_test_correct = evaluate(model, x_test, y_test)
    bn_train_loss, bn_train_correct = evaluate(model, x_train, y_train)
    result["bn_recal"] = {
        "test_error": float(1 - bn_test_correct.float().mean()),
        "test_loss": float(bn_test_loss.mean()),
        "test_class_error": per_class_error(bn_test_correct, y_test, classes),
        "train_error": float(1 - bn_train_correct.float().mean()),
        "train_loss": float(bn_train_loss.mean()),
        "running_mean_shift": [float((m.running_mean - sm).norm() / sm.norm().clamp_min(1e-12))
                               for m, (_, sm, _) in zip(norms, saved)],
        "running_var_ratio": [float((m.running_var / sv.clamp_min(1e-12)).mean())
                              for m, (_, _, sv) in zip(norms, saved)],
    }
    restore_batchnorm(norms, saved)

    # (c) examples not trained on lately, by passes and by steps (k epochs of Traditional's work)
    final_pass = epoch - 1
    steps_per_epoch_work = n / batch
    stale = {}
    for k in (1, 2, 4):
        by_pass = last_pass < final_pass - k + 1
        by_steps = last_step < step - k * steps_per_epoch_work
        stale[f"k{k}"] = {
            "by_pass": {"not_trained": group_stats(by_pass, train_loss, train_correct),
                        "trained": group_stats(~by_pass, train_loss, train_correct)},
            "by_steps": {"not_trained": group_stats(by_steps, train_loss, train_correct),
                         "trained": group_stats(~by_steps, train_loss, train_correct)},
        }
    result["stale"] = stale
    # distinct examples trained in the last share of the budget (diversity at low lr)
    step_at = lambda p: int(p * budget / batch)  # noqa: E731
    result["distinct_after"] = {str(p): int((last_step >= step_at(p)).sum()) for p in (0.5, 0.75, 0.875, 0.95)}
    hist = torch.bincount(times_trained)
    result["times_trained"] = {
        "mean": float(times_trained.double().mean()), "min": int(times_trained.min()),
        "max": int(times_trained.max()), "quantiles": quantiles(times_trained.double()),
        "histogram": hist.tolist(),
    }
    # training error by how often an example was trained (quintile-ish bins)
    edges = torch.quantile(times_trained.double(), torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64))
    bins = torch.bucketize(times_trained.double(), edges, right=True)
    result["by_times_trained"] = [
        {"bin": b, "times_min": int(times_trained[bins == b].min()) if (bins == b).any() else None,
         "times_max": int(times_trained[bins == b].max()) if (bins == b).any() else None,
         **group_stats(bins == b, train_loss, train_correct)}
        for b in range(5)
    ]
    # (e) forgetting: right at a checkpoint of the budget, wrong at the end
    result["forgetting"] = {
        str(c): {"right_then": float(corr.float().mean()),
                 "right_then_wrong_end": int((corr & ~train_correct).sum()),
                 "wrong_then_right_end": int((~corr & train_correct).sum())}
        for c, corr in checkpoint_correct.items()
    }
    result["epochs"] = epochs_log
    return result, {
        "train_loss": train_loss.numpy(), "train_correct": train_correct.numpy(),
        "test_correct": test_correct.numpy(), "bn_test_correct": bn_test_correct.numpy(),
        "times_trained": times_trained.numpy(), "last_step": last_step.numpy(),
        "last_pass": last_pass.numpy(), "scores": scores.numpy(), "train_labels": y_train.numpy(),
        **{f"correct_at_{c}": corr.numpy() for c, corr in checkpoint_correct.items()},
    }


def summary_line(r: dict) -> str:
    st = r["stale"]["k2"]["by_steps"]
    return (f"{r['strategy']:18s} seed {r['seed']}  test {100 * r['test_error']:.2f}%  "
            f"BN-recal {100 * r['bn_recal']['test_error']:.2f}%  train err {100 * r['train_error']:.2f}% "
            f"loss {r['train_loss']:.4f}  untrained-2ep {100 * st['not_trained']['share']:.1f}% "
            f"(err {100 * st['not_trained'].get('error', float('nan')):.2f}%)  passes {r['passes']}  "
            f"{r['seconds']:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=4.0, help="multiple of Traditional's base epochs")
    parser.add_argument("--base-epochs", type=float, default=5.0)
    parser.add_argument("--selectivity", type=float, default=1 / 3)
    parser.add_argument("--anneal-share", type=float, default=0.125)
    parser.add_argument("--test-every", type=float, default=0.05, help="share of the budget between test evaluations")
    parser.add_argument("--subset", type=int, default=None, help="a stratified subset of the training set (smoke tests)")
    parser.add_argument("--save-at", type=float, nargs="*", default=[],
                        help="shares of the budget at which to save the whole state (to resume a variant from)")
    parser.add_argument("--resume-from", default=None, help="a state saved by --save-at")
    parser.add_argument("--out", default="/tmp/diag")
    parser.add_argument("--tag", default="")
    parser.add_argument("--summarize", action="store_true", help="only print the summary of JSONs in --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.summarize:
        for path in sorted(out.glob("*.json")):
            print(summary_line(json.loads(path.read_text())))
        return
    out.mkdir(parents=True, exist_ok=True)
    result, arrays = run(args)
    name = f"{args.strategy}_b{args.budget:g}_s{args.seed}{args.tag}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    np.savez_compressed(out / f"{name}.npz", **arrays)
    print(summary_line(result), flush=True)


if __name__ == "__main__":
    main()
