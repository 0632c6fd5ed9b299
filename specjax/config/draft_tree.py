"""`speculative_config`'s draft tree: `tree_nodes` (the nodes one verify pass scores) and `tree_branching` (the
children a node may have, and for n-gram lookup the continuations it gathers); num_speculative_tokens is the
tree's depth. Off (a chain) unless tree_nodes is given. Under an adaptive speculation_policy the tiers are plain
steps and the tree."""
from __future__ import annotations

import dataclasses
from typing import Any

from specjax.config.validators import check_int

MAX_TREE_NODES = 128
DEFAULT_BRANCHING = 4


@dataclasses.dataclass(frozen=True)
class TreeShape:
    nodes: int       # drafted tokens a verify pass scores
    branching: int   # children per expanded node (EAGLE-2's top-k); continuations for n-gram lookup
    depth: int       # the longest path: num_speculative_tokens

    def drafted(self, method: str) -> int:
        """Nodes the drafter produces before the best `nodes` are kept: a head or draft model expands the best
        `branching` nodes of each level with their best `branching` children; n-gram lookup has `branching`
        chains."""
        if method == "ngram":
            return self.branching * self.depth
        return self.branching + (self.depth - 1) * self.branching ** 2

    @property
    def drafting_slots(self) -> int:
        """Cache slots past the committed end a drafter's level-by-level passes write."""
        return (self.depth - 1) * self.branching


def parse_tree(d: dict[str, Any], method: str, depth: int, draft_sample_method: str,
               synthetic: bool) -> TreeShape | None:
    """The tree from speculative_config's tree_nodes / tree_branching (None: chains), checked against the rest
    of the config; every error names the key and the fix."""
    nodes, branching = d.get("tree_nodes"), d.get("tree_branching")
    if nodes is None:
        if branching is not None:
            raise ValueError("speculative_config['tree_branching'] needs 'tree_nodes' (the tree's node budget, "
                             "e.g. 16): set it, or drop tree_branching to draft a chain")
        return None
    check_int(nodes, "speculative_config['tree_nodes']", minimum=1)
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"speculative_config['tree_nodes']={nodes} is more than {MAX_TREE_NODES}: use at most "
                         f"{MAX_TREE_NODES} nodes per verify pass")
    branching = DEFAULT_BRANCHING if branching is None else branching
    check_int(branching, "speculative_config['tree_branching']", minimum=1)
    if draft_sample_method != "greedy":
        raise ValueError("a draft tree keeps each node's best children (top-k, drafts without replacement): set "
                         "speculative_config['draft_sample_method'] to 'greedy' or drop tree_nodes")
    if synthetic:
        raise ValueError("speculative_config['rejection_sample_method'] 'synthetic' models chains only: use "
                         "'standard' or drop tree_nodes")
    shape = TreeShape(nodes=nodes, branching=branching, depth=depth)
    if nodes > shape.drafted(method):
        raise ValueError(f"speculative_config['tree_nodes']={nodes} is more than {method} drafts with depth "
                         f"num_speculative_tokens={depth} and tree_branching={branching} ({shape.drafted(method)} "
                         "nodes): lower tree_nodes or raise tree_branching / num_speculative_tokens")
    return shape
