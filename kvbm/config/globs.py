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


def may_name_slug(pattern: str, slug: str, truncated: bool = False) -> bool:
    """Whether a model name matching fnmatch ``pattern`` may have the namespace slug ``slug``
    (:func:`kvbm.blocks.keys.model_slug`); ``truncated``: ``slug`` is at the slug's length limit, so the name's
    slug may go on. Errs towards yes: a non-ASCII character or a negated class may fold to anything or nothing."""
    return overlap(_slug_pattern(pattern), slug + "*" if truncated else slug)


_SLUG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")


def _slug_char(c: str) -> str | None:
    """What one model-name character becomes in a slug (``None``: unknown, it may fold or vanish)."""
    if not c.isascii():
        return None
    c = c.lower()
    return c if c in _SLUG_CHARS else "-"


def _slug_pattern(pattern: str) -> str:
    """``pattern`` mapped into slug space: an fnmatch pattern every slug of a matching name matches."""
    out: list[str] = []
    replaced = False  # the last token was a character outside the slug's: a run of them becomes one "-"
    for tok in tokens(pattern):
        if tok is STAR:
            out.append("*")
            replaced = False
            continue
        negated, members = tok
        mapped = {_slug_char(c) for c in members}
        was, replaced = replaced, len(members) == 1 and not negated and mapped == {"-"} and members != {"-"}
        if replaced and was:
            continue
        if negated or tok == ANY or None in mapped:
            out.append("*")
        elif len(mapped) == 1:
            out.append(next(iter(mapped)))  # type: ignore[arg-type]
        else:
            chars = sorted(m for m in mapped if m is not None and m != "-")
            out.append("[" + "".join(chars) + ("-" if "-" in mapped else "") + "]")
    # A slug is trimmed of "._-" at both ends (runs of other characters became one "-" first).
    while out and out[0] in ("-", ".", "_"):
        out.pop(0)
    while out and out[-1] in ("-", ".", "_"):
        out.pop()
    return "".join(out)
