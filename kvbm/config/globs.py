"""Whether two ``fnmatch`` patterns (a tenant's ``models``) can match the same name, decided exactly.

A pattern is read as a sequence of tokens: ``*`` (any run of characters) or one character class (a literal,
``?``, ``[seq]``, ``[!seq]``). Two patterns share a name when the product of their token automata reaches
both ends: a breadth of at most (len(x) + 1) * (len(y) + 1) states.
"""

from __future__ import annotations

STAR = None  # the ``*`` token; every other token is a class (negated, characters)
Class = tuple[bool, frozenset[str]]
ANY: Class = (True, frozenset())  # ``?``: any one character


def tokens(pattern: str) -> list[Class | None]:
    """``pattern`` as fnmatch reads it (an unclosed ``[`` is a literal)."""
    out: list[Class | None] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] is not STAR:
                out.append(STAR)
        elif c == "?":
            out.append(ANY)
        elif c == "[":
            j = i + (i < n and pattern[i] == "!")
            j += j < n and pattern[j] == "]"  # a "]" right after "[" or "[!" is a member
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append((False, frozenset("[")))
                continue
            body, i = pattern[i:j], j + 1
            negated = body.startswith("!")
            out.append((negated, _members(body[1:] if negated else body)))
        else:
            out.append((False, frozenset(c)))
    return out


def _members(body: str) -> frozenset[str]:
    chars: set[str] = set()
    k = 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            chars.update(chr(o) for o in range(ord(body[k]), ord(body[k + 2]) + 1))
            k += 3
        else:
            chars.add(body[k])
            k += 1
    return frozenset(chars)


def _meet(a: Class, b: Class) -> bool:
    """Whether one character is in both classes (the alphabet is unbounded: two negated classes always meet)."""
    (neg_a, set_a), (neg_b, set_b) = a, b
    if neg_a and neg_b:
        return True
    if not neg_a and not neg_b:
        return bool(set_a & set_b)
    positive, excluded = (set_b, set_a) if neg_a else (set_a, set_b)
    return bool(positive - excluded)


def overlap(x: str, y: str) -> bool:
    """Whether some string matches both fnmatch patterns ``x`` and ``y`` (case-sensitive, as fnmatchcase)."""
    a, b = tokens(x), tokens(y)
    seen: set[tuple[int, int]] = set()
    todo = [(0, 0)]
    while todo:
        i, j = todo.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(a) and j == len(b):
            return True
        ta = a[i] if i < len(a) else False
        tb = b[j] if j < len(b) else False
        if ta is STAR:
            todo.append((i + 1, j))  # the star matches nothing more
        if tb is STAR:
            todo.append((i, j + 1))
        if ta is not False and tb is not False and _meet(ANY if ta is STAR else ta, ANY if tb is STAR else tb):
            todo.append((i if ta is STAR else i + 1, j if tb is STAR else j + 1))  # one character, both sides
    return False
