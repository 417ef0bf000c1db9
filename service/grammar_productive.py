"""Which rules of a grammar can never finish: a dead end the engine would only find mid-generation.

A rule is *productive* when it can derive a finite string. A JSON schema `{"$ref": "#"}`, a
`$ref` cycle, or an EBNF rule `x ::= x` converts to a grammar whose rules are not: the sampler's
token mask is empty once generation enters them, vLLM's engine rejects the sampled token and
fails the request (a 500 after it started). `dead_rules(ebnf)` finds such rules, reachable from
`root`, in the EBNF text xgrammar prints for a converted grammar (`str(xgrammar.Grammar)`).

Syntax read: `name ::= body` rules; strings, character classes (optionally `*`), rule
references, `( )` groups, `|`, postfix `* + ?` and `{m, n}`, `(= ...)` lookaheads (they consume
nothing; their rules must still be productive), and xgrammar's built-in forms such as
`Regex(...)` and `TagDispatch(...)` (productive; rules named inside them must be productive).
Anything else: `UnknownSyntax`, and the caller skips this check rather than guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RULE_HEAD = re.compile(r"^([A-Za-z_][\w.\-]*)\s*::=", re.MULTILINE)
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<charclass>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*-?\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<op>::=|\(=|[()|*+?,=])
""", re.VERBOSE | re.DOTALL)
MAX_GROUP_DEPTH = 200


class UnknownSyntax(ValueError):
    """The text uses a form this reader does not know."""


@dataclass
class _Rule:
    expr: tuple  # ("term",) | ("ref", name) | ("seq", [..]) | ("alt", [..]) | ("opt", e) | ("more", e)
    refs: set[str] = field(default_factory=set)  # every rule named in the body (lookaheads included)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise UnknownSyntax(f"unexpected {text[pos:pos + 20]!r}")
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


class _Parser:
    """Recursive descent over one grammar's tokens; `names` are the rule names it defines."""

    def __init__(self, tokens: list[tuple[str, str]], names: set[str]) -> None:
        self.toks, self.names, self.i = tokens, names, 0
        self.refs: set[str] = set()

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        j = self.i + ahead
        return self.toks[j] if j < len(self.toks) else ("end", "")

    def take(self, value: str) -> None:
        if self.peek()[1] != value:
            raise UnknownSyntax(f"expected {value!r}, got {self.peek()[1]!r}")
        self.i += 1

    def rules(self) -> dict[str, _Rule]:
        rules: dict[str, _Rule] = {}
        while self.peek()[0] != "end":
            kind, name = self.peek()
            if kind != "name" or self.peek(1)[1] != "::=":
                raise UnknownSyntax(f"expected a rule, got {name!r}")
            self.i += 2
            self.refs = set()
            expr = self.alternatives(0)
            rules[name] = _Rule(expr, self.refs)
        return rules

    def at_rule_start(self) -> bool:
        return self.peek()[0] == "name" and self.peek(1)[1] == "::="

    def alternatives(self, depth: int) -> tuple:
        if depth > MAX_GROUP_DEPTH:
            raise UnknownSyntax("groups nest too deeply")
        alts = [self.sequence(depth)]
        while self.peek()[1] == "|":
            self.i += 1
            alts.append(self.sequence(depth))
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self, depth: int) -> tuple:
        items = []
        while self.peek()[0] != "end" and self.peek()[1] not in ("|", ")") and not self.at_rule_start():
            items.append(self.item(depth))
        return items[0] if len(items) == 1 else ("seq", items)

    def item(self, depth: int) -> tuple:
        expr = self.atom(depth)
        while True:
            kind, value = self.peek()
            if value in ("*", "?"):
                expr = ("opt", expr)
            elif value == "+":
                expr = ("more", expr)
            elif kind == "repeat":
                low = int(value.strip("{} ").split(",")[0])
                expr = ("opt", expr) if low <= 0 else ("more", expr)
            else:
                return expr
            self.i += 1

    def atom(self, depth: int) -> tuple:
        kind, value = self.peek()
        self.i += 1
        if kind in ("string", "charclass"):
            return ("term",)
        if value == "(":
            expr = self.alternatives(depth + 1)
            self.take(")")
            return expr
        if value == "(=":  # lookahead: consumes nothing
            self.alternatives(depth + 1)
            self.take(")")
            return ("term",)
        if kind == "name" and value not in self.names and self.peek()[1] == "(":
            self.builtin_call()
            return ("term",)
        if kind == "name":
            self.refs.add(value)
            return ("ref", value)
        raise UnknownSyntax(f"unexpected {value!r}")

    def builtin_call(self) -> None:
        """`Regex(...)`, `TagDispatch(...)`: skip to the matching parenthesis, noting rule names."""
        level = 0
        while True:
            kind, value = self.peek()
            if kind == "end":
                raise UnknownSyntax("unclosed built-in call")
            self.i += 1
            if value in ("(", "(="):
                level += 1
            elif value == ")":
                level -= 1
                if level == 0:
                    return
            elif kind == "name" and value in self.names:
                self.refs.add(value)


def _productive(expr: tuple, done: set[str]) -> bool:
    kind = expr[0]
    if kind == "term" or kind == "opt":
        return True
    if kind == "ref":
        return expr[1] in done
    if kind == "more":
        return _productive(expr[1], done)
    if kind == "seq":
        return all(_productive(e, done) for e in expr[1])
    return any(_productive(e, done) for e in expr[1])  # alt


def dead_rules(ebnf: str, root: str = "root") -> list[str]:
    """Rules reachable from `root` that derive no finite string (in grammar order); [] if none.
    Raises UnknownSyntax for text this reader cannot follow."""
    names = set(_RULE_HEAD.findall(ebnf))
    rules = _Parser(_tokens(ebnf), names).rules()
    missing = sorted({r for rule in rules.values() for r in rule.refs} - rules.keys())
    if missing:
        raise UnknownSyntax(f"undefined rules {missing[:3]}")
    done: set[str] = set()
    changed = True
    while changed:  # least fixpoint: a rule is productive once one of its derivations is
        changed = False
        for name, rule in rules.items():
            if name not in done and _productive(rule.expr, done):
                done.add(name)
                changed = True
    reachable, todo = set(), [root] if root in rules else list(rules)
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo.extend(rules[name].refs)
    return [name for name in rules if name in reachable and name not in done]
