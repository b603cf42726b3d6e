"""The built-in strategies, one row each: every name a config accepts, in the order reports show them
(the two baselines, Traditional and the uniform random subset, first; Kath18's importance sampling last).

A strategy is its class, one file in raysb.training.selection.strategies, and its row here
(raysb.core.strategy_card.StrategyCard says what each field means): its settings of its own are the
row's options, with their defaults and checks, which its class reads from `spec.options`. A user's
own strategy is a card in their own module, named `package.module:CARD`: `strategy_card` finds either.
"""

from __future__ import annotations

from raysb.core.errors import ConfigError
from raysb.core.imports import import_named
from raysb.core.overfit_guard import GUARD_ACTIONS
from raysb.core.selectivity import trained_at_most
from raysb.core.strategy_card import StrategyCard, StrategyOption

_STRATEGIES = "raysb.training.selection.strategies"
_SELECTIVITY = frozenset({"selectivity", "beta"})
# What free-sb and stale-sb do with an example whose label the model persistently disagrees with
# (raysb.training.selection.label_doubt).
LABEL_DOUBT_RULES = ("off", "uniform", "tiered", "probe", "auto")
# The strategies that keep by SB's rule, P = CDF ** beta, which a selection-strength schedule weakens.
_KEEP_RULE = _SELECTIVITY | {"selection_strength_schedule"}


def _selectivity(spec) -> float:
    return spec.selectivity


def _presample_checks(spec) -> None:
    # Its presample of B = b / s examples must hold more than the batch of b it draws (Kath18, RHO-LOSS).
    if not spec.selectivity < 1:
        raise ValueError(f"selectivity must be < 1 for {spec.strategy} (B > b), got {spec.selectivity!r}")


def _presample(spec) -> int:
    # B = b / s examples a round, one more than the batch it draws at the least.
    return max(spec.batch_size + 1, round(spec.batch_size / spec.selectivity))


def _free_sb_checks(spec) -> None:
    _train_cap_checks(spec)
    _overfit_guard_checks(spec)
    refresh = spec.options["score_refresh_epochs"]
    if refresh is None:
        return
    if refresh < 1:
        raise ValueError(f"score_refresh_epochs must be >= 1 epoch, got {refresh!r}")
    # A refresh scores old examples with a forward of their own, chunk by chunk.
    if spec.sharded_table:
        raise ValueError("loss_table sharded decides every epoch as it starts, which score_refresh_epochs does not: "
                         "use loss_table replicated")


def _train_cap_checks(spec) -> None:
    cap, window = spec.options["train_cap"], spec.options["train_cap_window"]
    if window < 1:
        raise ValueError(f"train_cap_window must be >= 1 epoch, got {window!r}")
    if cap is None:
        return
    if trained_at_most(cap, spec.selectivity, window) < 1:
        raise ValueError(f"train_cap {cap!r} lets no example be trained in a window of {window} epochs at selectivity "
                         f"{spec.selectivity:.3g} (K s W must be >= 1)")
    # Each rank would count only the keeps it decided, and examples move between ranks' shards.
    if spec.lockstep:
        raise ValueError("train_cap counts each example's keeps in one process: run free-sb with it in one "
                         "(no workers, or workers=1)")


def _overfit_guard_checks(spec) -> None:
    if spec.options["overfit_guard"] == "off":
        return
    share = spec.options["guard_holdout_share"]
    if not 0 < share < 1:
        raise ValueError(f"guard_holdout_share must be in (0, 1), got {share!r}")
    # The held-out loss would be each rank's, read with its own BatchNorm statistics.
    if spec.lockstep:
        raise ValueError("overfit_guard reads a held-out loss in one process: run free-sb with it in one "
                         "(no workers, or workers=1)")


def _free_sb_holdout(spec) -> float:
    return 0.0 if spec.options["overfit_guard"] == "off" else spec.options["guard_holdout_share"]


def _rho_loss_checks(spec) -> None:
    _presample_checks(spec)
    share, epochs = spec.options["holdout_share"], spec.options["irreducible_epochs"]
    if not 0 < share < 1:
        raise ValueError(f"holdout_share must be in (0, 1) (the irreducible-loss model trains on it), got {share!r}")
    if epochs < 1:
        raise ValueError(f"irreducible_epochs must be >= 1, got {epochs!r}")


# InfoBatch's authors keep at least a tenth of the below-mean examples (keep_ratio = max(0.1, 1 - r)).
INFOBATCH_MAX_PRUNE_RATIO = 0.9


def _infobatch_checks(spec) -> None:
    prune_ratio, delta = spec.options["infobatch_prune_ratio"], spec.options["infobatch_delta"]
    if not 0 < prune_ratio <= INFOBATCH_MAX_PRUNE_RATIO:
        raise ValueError(f"infobatch_prune_ratio must be in (0, {INFOBATCH_MAX_PRUNE_RATIO}] (InfoBatch keeps at "
                         f"least a tenth of the below-mean examples), got {prune_ratio!r}")
    if not 0 < delta <= 1:
        raise ValueError(f"infobatch_delta must be in (0, 1], got {delta!r}")


def _stale_sb_checks(spec) -> None:
    if spec.options["staleness"] < 1:
        raise ValueError(f"staleness must be >= 1, got {spec.options['staleness']!r}")
    # The authors' schedule is the scored priming epoch at first_epoch 0.
    if spec.options["stale_sb_schedule"] == "authors" and spec.first_epoch:
        raise ValueError("stale_sb_schedule authors primes one epoch of its own (scored, the pass at epoch 0): "
                         f"leave prime_epochs at 0, got {spec.first_epoch}")
    # auto measures the labels over the examples an epoch trained, which a selection pass's records
    # (every example's loss, no training) would swamp.
    if spec.options["label_doubt"] == "auto":
        raise ValueError("label_doubt auto is free-sb's: for stale-sb choose the rule, tiered on labels you "
                         "doubt (uniform, probe or off)")


STRATEGIES: dict[str, StrategyCard] = {card.name: card for card in (
    StrategyCard(
        "traditional", "plain SGD: every example, every epoch", f"{_STRATEGIES}.traditional:Traditional",
        scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: 1.0, selects=False, colour="tab:blue",
    ),
    StrategyCard(
        "uniform", "RS2: a fresh uniform random subset each epoch, no scoring forward",
        f"{_STRATEGIES}.uniform:UniformStrategy",
        scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: selectivity, settings=_SELECTIVITY,
        chunk_kept_share=_selectivity, keeps_fraction=True, random_subset=True, colour="tab:gray",
    ),
    StrategyCard(
        "sb", "Selective-Backprop: every example scored each epoch, kept with probability CDF_R(loss) ** beta",
        f"{_STRATEGIES}.sb:SBStrategy",
        scored_share=lambda staleness: 1.0, kept_share=lambda selectivity: selectivity, settings=_KEEP_RULE,
        chunk_kept_share=_selectivity, keeps_fraction=True, shared_cdf=True, cdf_report=True, colour="tab:orange",
    ),
    StrategyCard(
        "stale-sb", "SB's selection pass every n-th epoch, its recorded losses reused in between",
        f"{_STRATEGIES}.stale_sb:StaleSBStrategy",
        scored_share=lambda staleness: 1.0 / staleness, kept_share=lambda selectivity: selectivity,
        settings=_KEEP_RULE, chunk_kept_share=_selectivity, keeps_fraction=True, shared_cdf=True, cdf_report=True,
        needs_sample_ids=True, keeps_margins="label_doubt", colour="tab:green", check=_stale_sb_checks,
        options={
            # n: a selection pass every n-th epoch.
            "staleness": StrategyOption(3, "int", elsewhere=1),
            # Each trained example's training loss replaces its recorded score between selection passes
            # (BENCHMARKS.md, "Selection that pays").
            "training_loss_refresh": StrategyOption(False, "bool"),
            # raysb: passes at epochs p, p + n, ... after p = prime_epochs unscored plain-SGD epochs.
            # authors (angelajiang/SelectiveBackprop): a scored plain-SGD first epoch is the pass at epoch
            # 0, then passes at n, 2n, ..., each trained example's training loss replacing its recorded one.
            "stale_sb_schedule": StrategyOption("raysb", "str", choices=("raysb", "authors")),
            # As free-sb's label_doubt, from the training forwards' margins; off by default until
            # tables with flipped labels and clean ones say what it costs Stale-SB (BENCHMARKS.md).
            "label_doubt": StrategyOption("off", "str", choices=LABEL_DOUBT_RULES, elsewhere="off"),
        },
    ),
    StrategyCard(
        # Only the optional refresh of old scores runs a scoring forward.
        "free-sb", "SB's keep rule on free scores, each example's loss in the last training step it was in",
        f"{_STRATEGIES}.free_sb:FreeSBStrategy",
        scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: selectivity,
        # The guard's held-out forwards are scored work too.
        settings=_KEEP_RULE,
        scores=lambda spec: spec.options["score_refresh_epochs"] is not None or spec.options["overfit_guard"] != "off",
        chunk_kept_share=_selectivity, keeps_fraction=True, cdf_report=True, needs_sample_ids=True, keeps_margins=True,
        shardable_table=True, colour="tab:purple", check=_free_sb_checks, holdout_share=_free_sb_holdout,
        options={
            # An example whose score (its last training loss) is older than this many epochs is scored
            # again by a selection forward; None: never.
            "score_refresh_epochs": StrategyOption(None, "int | None"),
            # unbiased: each kept example's loss weighs mean(P) / P (at most 10), so a step's gradient
            # estimates the whole data's, as InfoBatch's rescaling does.
            "selection_weights": StrategyOption("none", "str", choices=("none", "unbiased")),
            # K: no example is kept in more than floor(K s W) of any W = train_cap_window consecutive
            # epochs, K times what a uniform draw of s keeps it in (raysb.core.train_cap); None: no cap.
            "train_cap": StrategyOption(None, "float | None"),
            # W, the window of consecutive epochs train_cap counts an example's keeps in.
            "train_cap_window": StrategyOption(6, "int"),
            # When the loss on a held-out share of the training data (guard_holdout_share, never trained
            # on) rises while the trained examples' loss collapses (raysb.core.overfit_guard), move
            # selection half way toward a uniform draw of the same fraction (strength: the keep rule's)
            # or toward keeping every example (fraction: the kept fraction); off: never.
            "overfit_guard": StrategyOption("off", "str", choices=("off", *GUARD_ACTIONS)),
            # The share of the training data held out (seeded, stratified, never trained on) for
            # overfit_guard's held-out loss.
            "guard_holdout_share": StrategyOption(0.03, "float"),
            # An example the model disagrees with (its running margin below 0, raysb.core.label_doubt) is
            # drawn at the uniform rate s, not ranked: uniform trains it as any other, probe with loss
            # weight 0 (its margin stays current, its label teaches nothing), tiered with loss weight 0
            # once the model is confident its label is wrong (at its fourth training or later); off ranks
            # it by its loss; auto measures the labels once, as the third epoch starts, and is tiered for
            # the rest of the run where over 10% look wrong, off where fewer do
            # (raysb.core.label_doubt.automatic_rule). auto by default: on
            # clean labels it ended within off's seeds (0.35 below to 0.29 above it, seed for seed), with
            # flipped labels below Traditional where off ended up to 10.5 points above it (BENCHMARKS.md,
            # "Silenced after four trainings, and auto the default").
            # Elsewhere off: a strategy that does not read it doubts nothing, and records so.
            "label_doubt": StrategyOption("auto", "str", choices=LABEL_DOUBT_RULES, elsewhere="off"),
        },
    ),
    StrategyCard(
        # About half the examples fall below the mean score: it keeps 1 - r of those and all the others
        # (the cost model's 0.75 at its default r = 0.5).
        "infobatch", "InfoBatch: a random share of the below-mean free scores pruned, the rest rescaled",
        f"{_STRATEGIES}.infobatch:InfoBatchStrategy",
        scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: 0.75,
        chunk_kept_share=lambda spec: 1.0 - spec.options["infobatch_prune_ratio"] / 2, needs_sample_ids=True,
        keeps_margins=True, shardable_table=True,
        own_loop_refusal=("stops pruning for the last 12.5% of the run, whose length your loop knows and raysb "
                          "does not: use raysb's trainer (raysb train --strategy infobatch)"),
        colour="tab:brown", check=_infobatch_checks,
        options={
            # The share of below-mean examples dropped each epoch (Qin et al.'s r, at most 0.9).
            "infobatch_prune_ratio": StrategyOption(0.5, "float"),
            # The share of the run (epochs, or the budget) that prunes; the rest trains on everything
            # (Qin et al.'s delta).
            "infobatch_delta": StrategyOption(0.875, "float"),
        },
    ),
    StrategyCard(
        # Every presample is scored; the irreducible-loss model's training and its forward over the
        # training set are the run's work too (a work budget counts them).
        "rho-loss", "RHO-LOSS (Mindermann et al., 2022): the top s of a presample of b / s by reducible loss, "
        "the loss minus an irreducible loss from a model trained on a held-out split",
        f"{_STRATEGIES}.rho_loss:RhoLossStrategy",
        scored_share=lambda staleness: 1.0, kept_share=lambda selectivity: selectivity,
        settings=_SELECTIVITY, chunk_size=_presample, colour="tab:olive", check=_rho_loss_checks,
        holdout_share=lambda spec: spec.options["holdout_share"],
        lockstep_refusal="trains its irreducible-loss model in one process: run it in one (no workers, or workers=1)",
        options={
            # The held-out share of the training data (seeded, stratified, never trained on) the
            # irreducible-loss model trains on: the run's own model and recipe.
            "holdout_share": StrategyOption(0.1, "float", elsewhere=0.0),
            # The irreducible-loss model's epochs on the held-out share.
            "irreducible_epochs": StrategyOption(5, "int", elsewhere=0),
        },
    ),
    StrategyCard(
        # Once importance sampling is on, it scores the whole presample every step.
        "kath18", "Katharopoulos & Fleuret (2018): one batch of b importance-sampled from a presample of b / s",
        f"{_STRATEGIES}.kath18:Kath18Strategy",
        scored_share=lambda staleness: 1.0, kept_share=lambda selectivity: selectivity,
        settings=_SELECTIVITY, chunk_size=_presample, colour="tab:red", check=_presample_checks,
        options={
            # The variance-reduction estimate above which importance sampling starts; None: the authors'
            # for the presample's size (raysb.core.importance_sampling.default_tau_threshold).
            "kath18_tau_threshold": StrategyOption(None, "float | None"),
            # Weigh each sampled example's loss for an unbiased gradient.
            "kath18_reweight": StrategyOption(False, "bool"),
        },
    ),
)}


# Users' own cards a Ray Train driver resolved and sent to this worker, by name.
_HANDED_OVER: dict[str, StrategyCard] = {}


def hand_over_card(name: str, card: StrategyCard) -> None:
    """Resolve `name` to `card` from now on in this process, without importing its module."""
    _HANDED_OVER[name] = card


def strategy_card(name: str) -> StrategyCard:
    """The card of built-in strategy `name`, or of a user's own named `package.module:CARD`
    (imported from the working directory as `python -m` would find it)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in _HANDED_OVER:
        return _HANDED_OVER[name]
    module_name, sep, attribute = name.partition(":")
    if not (module_name and sep and attribute):
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}, "
                          "or your own as package.module:CARD")
    card = getattr(import_named(module_name, f"strategy {name!r}", ConfigError), attribute, None)
    if not isinstance(card, StrategyCard):
        raise ConfigError(f"strategy {name!r}: {module_name} has no StrategyCard {attribute}")
    return card


def known_card(name: str) -> StrategyCard | None:
    """The card `name` resolves to, or None: analysis reads labels that name no strategy, and runs of
    strategies whose module cannot be imported where they are read, and draws those without one."""
    try:
        return strategy_card(name)
    except ConfigError:
        return None


def strategies_keeping_margins() -> list[str]:
    """The built-in strategies whose runs keep margins (StrategyCard.keeps_margins), as a message names
    them: those that always do first ("free-sb"), then those an option turns them on for ("stale-sb with
    label_doubt on")."""
    always = [name for name, card in STRATEGIES.items() if card.keeps_margins is True]
    optional = [f"{name} with {card.keeps_margins} on" for name, card in STRATEGIES.items()
                if isinstance(card.keeps_margins, str)]
    return always + optional


def strategies_reading(key: str) -> list[str]:
    """The built-in strategies whose cards read config key `key` (raysb.core.strategy_card.StrategyCard.reads)."""
    return [name for name, card in STRATEGIES.items() if card.reads(key)]


# The built-in strategy that trains on every example of every epoch, the reference every comparison
# is measured against (Traditional): found by its card, so a module that trains one (RHO-LOSS's
# irreducible-loss model, raysb.training.irreducible_loss) names no strategy.
REFERENCE_STRATEGY = next(name for name, card in STRATEGIES.items() if not card.selects)
