"""What raysb knows of a strategy besides its class: `StrategyCard`. Pure Python, so the config,
the analysis and the benchmarks read it without torch.

The built-in strategies' cards are the rows of raysb.core.strategy_table; a user's own strategy
is a card in their own module, named `package.module:CARD` where a strategy name goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The card's functions take a SelectionSpec (raysb.core.spec), named in their annotations but not
# imported, not even for type checkers: the spec reads every card through the strategy table, which
# imports this module, and raysb's modules import in no circle (tests/test_layers.py).


@dataclass(frozen=True)
class StrategyOption:
    """An option of a strategy declared with its type. A built-in strategy's options are config keys
    of their own as well (`infobatch_prune_ratio: 0.3`, `--set staleness=2`, raysb.config): the type
    says what a YAML or command-line value becomes, and what an error says it must be."""

    default: Any
    # As a config key's annotation reads: "int", "float | None", "bool", "str".
    kind: str
    # The only values it takes, where it is a choice.
    choices: tuple = ()
    # What a run of a strategy without this option holds for its config key, and accepts there (an old
    # run's config.yaml holds every key): Stale-SB's staleness 3 is 1, every epoch, elsewhere.
    # None: its default.
    elsewhere: Any = None

    def value_elsewhere(self) -> Any:
        return self.default if self.elsewhere is None else self.elsewhere


@dataclass(frozen=True)
class StrategyCard:
    """One strategy: its name, what it costs and keeps, the settings it reads and their checks, what
    analysis draws for it, and the class that implements it."""

    name: str
    # One line: what it does.
    summary: str
    # "package.module:Class", a subclass of `raysb.Strategy` whose
    # classmethod build(spec, *, history, sample_ids, device) builds it for a run.
    implementation: str
    # Share of an epoch's examples given a selection forward, from the staleness n (the cost model;
    # above 0, a work budget measures the scoring cost).
    scored_share: Callable[[int], float]
    # Share of an epoch's examples trained on, from the selectivity s (the cost model).
    kept_share: Callable[[float], float]
    # It selects: False only for a strategy that trains on every example of every epoch (Traditional,
    # the reference), which has no kept examples to report and no epochs that would select.
    selects: bool = True
    # Whether a run spends forwards of its own on scoring, from its SelectionSpec (a work budget then
    # measures their cost); None: where scored_share is above 0.
    scores: Callable[[SelectionSpec], bool] | None = None
    # The examples each of its selection rounds reads, from the run's SelectionSpec; None: the
    # selection batch.
    chunk_size: Callable[[SelectionSpec], int] | None = None
    # The config keys of every strategy's that it reads (selectivity, beta, the selection-strength
    # schedule), besides its options. A key only some strategies read is refused for a strategy whose
    # card does not list it; a search leaves such keys out of its trials.
    settings: frozenset[str] = frozenset()
    # About the share of each selection chunk it keeps, from the run's SelectionSpec: lockstep ranks
    # exchange once each holds about a batch. None: a chunk yields whole batches (all of it, or one
    # batch of b), so every round exchanges.
    chunk_kept_share: Callable[[SelectionSpec], float] | None = None
    # It keeps about a selectivity's share of each chunk, which a kept-fraction schedule can set.
    keeps_fraction: bool = False
    # It ranks losses on CDF_R: lockstep ranks in a user's loop share one (a merged histogram).
    shared_cdf: bool = False
    # It keeps an example with probability CDF(score) ** beta: its runs record the CDF history, the
    # gradient probes and the tracked decisions, which `raysb report` draws.
    cdf_report: bool = False
    # Its loss table keeps each trained example's running margin (the given label's logit less the largest
    # other), from which its runs estimate the share of wrong labels and write label_suspects.parquet
    # (raysb.training.label_suspects): True; or the name of its option that turns them on where that option
    # is not "off"; False: it keeps none.
    keeps_margins: bool | str = False
    # It keeps a state per example (its last loss), found by sample id: a user's loop names an id column.
    needs_sample_ids: bool = False
    # It decides every epoch from its loss table alone as the epoch starts, so lockstep ranks may each
    # hold only the examples they own (`loss_table: sharded`).
    shardable_table: bool = False
    # Why a user's own loop (raysb.SelectiveBackprop) cannot run it, after "strategy NAME "; None: it can.
    own_loop_refusal: str | None = None
    # Why lockstep ranks cannot run it, after "strategy NAME "; None: they can.
    lockstep_refusal: str | None = None
    # The share of the training data its runs hold out, from the run's SelectionSpec: a seeded, stratified
    # split never trained on (raysb.data.prepare.split_holdout), which the strategy reads through
    # Strategy.irreducible_epochs and Strategy.watches_held_out. None: nothing held out.
    holdout_share: Callable[[SelectionSpec], float] | None = None
    # The uniform random subset of a selectivity's size, no scoring: the baseline every selective
    # strategy is compared with in reports (one card).
    random_subset: bool = False
    # Its colour in every figure (matplotlib's name); None: one of the spare colours.
    colour: str | None = None
    # Settings of its own: name -> default, or a StrategyOption (its default, type and choices). A run
    # sets them with `strategy_options` (a config key, and SelectiveBackprop's argument), which refuses
    # any other name, and a built-in strategy's also with config keys of their own names; its class
    # reads them, resolved, from `spec.options`, and `check` checks their values.
    options: Mapping[str, Any] = field(default_factory=dict)
    # Its own checks of the run's resolved selection settings, raising ValueError (a config's become
    # ConfigErrors).
    check: Callable[[SelectionSpec], None] | None = None

    def __post_init__(self) -> None:
        module, sep, attribute = self.implementation.partition(":")
        if not (module and sep and attribute):
            raise ValueError(f"strategy {self.name}: implementation must be package.module:Class, "
                             f"got {self.implementation!r}")

    def option_defaults(self) -> dict[str, Any]:
        """Each option's default, declared as a StrategyOption or as the default alone."""
        return {name: option.default if isinstance(option, StrategyOption) else option
                for name, option in self.options.items()}

    def margins_kept(self, options: Mapping[str, Any]) -> bool:
        """Whether a run with these resolved options keeps margins (`keeps_margins`)."""
        if isinstance(self.keeps_margins, str):
            return options[self.keeps_margins] != "off"
        return self.keeps_margins

    def reads(self, key: str) -> bool:
        """Whether a run of it reads config key `key`: one of its settings or its options."""
        return key in self.settings or key in self.options
