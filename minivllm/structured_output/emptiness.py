"""Chapter 10 — does a grammar match any string at all?

An EBNF grammar can parse and still match nothing: `root ::= root` never gets to a character,
and `root ::= "a" root` never ends. A request with such a grammar could only fail (no token
is ever allowed) or run to max_tokens, so it is refused when it arrives, with the grammar's
other errors (`parse_grammar`).

The test is the textbook one for context-free grammars. A rule is *productive* if some
alternative of it is a sequence of pieces that are all productive: a literal, a character
class, the empty string, a repetition that may be empty, or a reference to a productive rule.
Start with no rule productive, mark the rules that become so, and repeat until nothing
changes: the grammar matches a finite string exactly when its root rule ends up productive.

The rules are read from xgrammar's own serialized form of the grammar (its normalized
expressions, in the layout of serialization format v18); a grammar in a layout this module
does not know is assumed to match something, so that no valid grammar is ever refused.
"""

from __future__ import annotations

import json

KNOWN_FORMAT = "v18"
# xgrammar's expression kinds (GrammarExprType) whose productivity depends on other rules;
# every other kind (literals, character classes, the empty string, tag dispatch, tokens)
# matches some finite text by itself.
RULE_REF, SEQUENCE, CHOICES, REPEAT = 4, 5, 6, 8


def matches_a_finite_string(grammar) -> bool:
    """Whether the xgrammar Grammar matches at least one finite string."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != KNOWN_FORMAT:
        return True
    expressions, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    bodies = [rule[1] for rule in data["rules"]]  # each rule: [name, body expression, ...]
    productive = [False] * len(bodies)

    def expression_is_productive(expression: int) -> bool:
        start = starts[expression]
        kind, size = expressions[start], expressions[start + 1]  # [kind, size, payload...]
        payload = expressions[start + 2 : start + 2 + size]
        if kind == RULE_REF:
            return productive[payload[0]]
        if kind == SEQUENCE:
            return all(expression_is_productive(part) for part in payload)
        if kind == CHOICES:
            return any(expression_is_productive(part) for part in payload)
        if kind == REPEAT:  # [rule, fewest, most]
            return payload[1] == 0 or productive[payload[0]]
        return True

    changed = True
    while changed:
        changed = False
        for rule, body in enumerate(bodies):
            if not productive[rule] and expression_is_productive(body):
                productive[rule] = changed = True
    return productive[data["root_rule_id"]]
