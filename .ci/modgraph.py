#!/usr/bin/env python3
"""Import cycles among a Rust crate's top-level modules.

Usage:
  modgraph.py [--edges] --crate NAME=ROOT [--crate NAME=ROOT ...]
  modgraph.py [--edges] ROOT [ROOT ...]
  modgraph.py --self-test

ROOT is a crate's root file (`indexd/src/lib.rs`). The module tree follows
`mod x;` declarations, inline `mod x { ... }` blocks, `#[path = "..."]`
attributes, `x.rs` beside an `x/` directory and `mod.rs`. Test-only code is
left out: items under `#[cfg(test)]` (including `#[cfg(test)] mod tests;`)
and files named `*_tests.rs`.

A reference is a path in code (never in a comment or a string) that starts
with `crate::`, `super::` or `self::`, or a `use` of a child module without a
prefix; `use` trees with groups (`use crate::{a::X, b::{Y, Z}}`), `self` in
groups, renames and globs are followed. A path names the deepest module that
exists: `crate::state::lock` refers to `state`. A name that the crate root
imports with `use` (a re-export such as `pub use runner::Profile;`) refers to
the module the import names; a re-export elsewhere is the re-exporting
module's own.

Every module collapses to its top-level module under the crate root (the
file `index/lookup.rs` belongs to `index`). References inside one top-level
module and references from or to the crate root itself are no edges. The
strongly connected components of more than one top-level module are the
cycles; each is printed with the edges that tie it, file -> file: names.

With --edges, every edge between top-level modules is printed as well.

Exit status: 0 when no crate has a cycle ("no cycle"), 1 when one does, 2 on
a usage error or an unreadable root.
"""

import argparse
import os
import signal
import sys
import tempfile
from collections import defaultdict, deque

# --------------------------------------------------------------------------
# Tokens


class Tok:
    __slots__ = ("kind", "text", "line")

    def __init__(self, kind, text, line):
        self.kind = kind  # "ident", "punct", "str", "lit"
        self.text = text
        self.line = line

    def __repr__(self):
        return f"{self.kind}:{self.text}"


def _ident_start(c):
    return c == "_" or c.isalpha()


def _ident_char(c):
    return c == "_" or c.isalnum()


def tokenize(src):
    """Rust source as tokens, without comments; strings become one token."""
    toks = []
    i = 0
    n = len(src)
    line = 1

    def scan_quoted(j, quote):
        # j is just past the opening quote; returns the index past the close.
        nonlocal line
        while j < n:
            c = src[j]
            if c == "\\":
                j += 2
                continue
            if c == "\n":
                line += 1
            if c == quote:
                return j + 1
            j += 1
        return n

    def scan_raw(j):
        # j points at the first '#' or '"' after the `r`; returns index past it.
        nonlocal line
        hashes = 0
        while j < n and src[j] == "#":
            hashes += 1
            j += 1
        if j >= n or src[j] != '"':
            return None
        j += 1
        close = '"' + "#" * hashes
        end = src.find(close, j)
        if end < 0:
            end = n
        line += src.count("\n", j, end)
        return end + len(close)

    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c.isspace():
            i += 1
            continue
        if src.startswith("//", i):
            end = src.find("\n", i)
            i = n if end < 0 else end
            continue
        if src.startswith("/*", i):
            depth = 1
            j = i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth += 1
                    j += 2
                elif src.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    if src[j] == "\n":
                        line += 1
                    j += 1
            i = j
            continue
        start_line = line
        # String-like literals with prefixes: b"", r"", br"", c"", cr"", b''.
        m = None
        for prefix in ("br", "cr", "b", "c", "r"):
            if src.startswith(prefix, i):
                after = i + len(prefix)
                if after < n and (src[after] == '"' or (src[after] == "#" and "r" in prefix)):
                    m = prefix
                    break
                if prefix == "b" and after < n and src[after] == "'":
                    m = prefix
                    break
        if m is not None:
            after = i + len(m)
            if "r" in m:
                end = scan_raw(after)
                if end is not None:
                    body = src[after:end].strip("#")
                    toks.append(Tok("str", body[1:-1], start_line))
                    i = end
                    continue
            elif src[after] == '"':
                end = scan_quoted(after + 1, '"')
                toks.append(Tok("str", src[after + 1 : end - 1], start_line))
                i = end
                continue
            else:  # b'x'
                end = scan_quoted(after + 1, "'")
                toks.append(Tok("lit", src[i:end], start_line))
                i = end
                continue
        if c == "r" and src.startswith("r#", i) and i + 2 < n and _ident_start(src[i + 2]):
            j = i + 2
            while j < n and _ident_char(src[j]):
                j += 1
            toks.append(Tok("ident", src[i + 2 : j], start_line))
            i = j
            continue
        if _ident_start(c):
            j = i + 1
            while j < n and _ident_char(src[j]):
                j += 1
            toks.append(Tok("ident", src[i:j], start_line))
            i = j
            continue
        if c.isdigit():
            j = i + 1
            while j < n and _ident_char(src[j]):
                j += 1
            toks.append(Tok("lit", src[i:j], start_line))
            i = j
            continue
        if c == '"':
            end = scan_quoted(i + 1, '"')
            toks.append(Tok("str", src[i + 1 : end - 1], start_line))
            i = end
            continue
        if c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime / label ('a).
            if i + 1 < n and src[i + 1] == "\\":
                end = scan_quoted(i + 1, "'")
                toks.append(Tok("lit", src[i:end], start_line))
                i = end
                continue
            if i + 2 < n and src[i + 2] == "'":
                toks.append(Tok("lit", src[i : i + 3], start_line))
                i += 3
                continue
            j = i + 1
            while j < n and _ident_char(src[j]):
                j += 1
            toks.append(Tok("lit", src[i:j], start_line))
            i = max(j, i + 1)
            continue
        if src.startswith("::", i):
            toks.append(Tok("punct", "::", start_line))
            i += 2
            continue
        toks.append(Tok("punct", c, start_line))
        i += 1
    return toks


# --------------------------------------------------------------------------
# Parsing one file


def _is(tok, text, kind=None):
    return tok is not None and tok.text == text and (kind is None or tok.kind == kind)


def _matching(toks, i):
    """Index of the bracket closing the one at toks[i]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    j = i
    while j < len(toks):
        t = toks[j]
        if t.kind == "punct":
            if t.text in pairs:
                stack.append(pairs[t.text])
            elif t.text in (")", "]", "}"):
                if stack:
                    stack.pop()
                if not stack:
                    return j
        j += 1
    return len(toks) - 1


def _attr_is_cfg_test(attr):
    """True for `cfg(test)` and `cfg(all(test, ...))`; false under `not`."""
    if not attr or attr[0].text != "cfg":
        return False
    texts = [t.text for t in attr if t.kind == "ident"]
    return "test" in texts and "not" not in texts


def _attr_path(attr):
    if len(attr) >= 3 and attr[0].text == "path" and attr[1].text == "=" and attr[2].kind == "str":
        return attr[2].text
    return None


def _skip_item(toks, i):
    """Index past the item starting at toks[i]: its `;` or its closing brace."""
    j = i
    while j < len(toks):
        t = toks[j]
        if t.kind == "punct":
            if t.text in ("(", "["):
                j = _matching(toks, j) + 1
                continue
            if t.text == "{":
                return _matching(toks, j) + 1
            if t.text in (";", "}"):
                return j + 1 if t.text == ";" else j
        j += 1
    return j


class Ref:
    """One path in code: where it is and its segments as written."""

    __slots__ = ("module", "file", "line", "segs", "kind", "alias", "glob")

    def __init__(self, module, file, line, segs, kind, alias=None, glob=False):
        self.module = module  # tuple: the module the path is written in
        self.file = file
        self.line = line
        self.segs = segs  # list of segment strings, starting with crate/super/self or a name
        self.kind = kind  # "use" or "path"
        self.alias = alias
        self.glob = glob


def _parse_use_tree(toks, i, prefix, out):
    """Parses a use tree at toks[i]; appends (segs, alias, glob, line) to out."""
    segs = list(prefix)
    line = toks[i].line if i < len(toks) else 0
    while i < len(toks):
        t = toks[i]
        if t.kind == "punct" and t.text == "{":
            end = _matching(toks, i)
            j = i + 1
            while j < end:
                if _is(toks[j], ","):
                    j += 1
                    continue
                j = _parse_use_tree(toks, j, segs, out)
                if j < end and _is(toks[j], ","):
                    j += 1
            return end + 1
        if t.kind == "punct" and t.text == "*":
            out.append((segs, None, True, t.line))
            return i + 1
        if t.kind == "punct" and t.text == "::":
            i += 1
            continue
        if t.kind == "ident":
            segs = segs + [t.text]
            i += 1
            if i < len(toks) and _is(toks[i], "::"):
                continue
            alias = None
            if i + 1 < len(toks) and _is(toks[i], "as", "ident"):
                alias = toks[i + 1].text
                i += 2
            out.append((segs, alias, False, line))
            return i
        if t.kind == "punct" and t.text == "$" and i + 1 < len(toks):
            i += 1
            continue
        return i + 1
    return i


def parse_file(toks, module, file):
    """Child module declarations and references of one file.

    Returns (decls, inline_modules, refs, test_only): decls are
    (parent module, name, path attribute or None, inline names) for `mod x;`,
    inline modules are module path tuples.
    """
    decls = []
    inline_mods = []
    refs = []
    test_only = False
    # Stack of (module path, inline names within this file, brace depth at open).
    stack = [(module, (), 0)]
    depth = 0
    attrs = []
    i = 0
    n = len(toks)
    while i < n:
        t = toks[i]
        cur, inl, _ = stack[-1]
        if t.kind == "punct" and t.text == "#" and i + 1 < n:
            inner = _is(toks[i + 1], "!")
            k = i + 2 if inner else i + 1
            if k < n and _is(toks[k], "["):
                end = _matching(toks, k)
                attr = toks[k + 1 : end]
                if inner:
                    if _attr_is_cfg_test(attr) and depth == 0:
                        test_only = True
                else:
                    attrs.append(attr)
                i = end + 1
                continue
        if attrs:
            pending = attrs
            attrs = []
            if any(_attr_is_cfg_test(a) for a in pending):
                i = _skip_item(toks, i)
                continue
        else:
            pending = []
        # Visibility before `mod`/`use`: `pub`, `pub(crate)`, `pub(in path)`.
        j = i
        if _is(t, "pub", "ident"):
            j = i + 1
            if j < n and _is(toks[j], "("):
                j = _matching(toks, j) + 1
        if j < n and _is(toks[j], "mod", "ident") and j + 1 < n and toks[j + 1].kind == "ident":
            name = toks[j + 1].text
            after = toks[j + 2] if j + 2 < n else None
            path_attr = None
            for a in pending:
                p = _attr_path(a)
                if p is not None:
                    path_attr = p
            if _is(after, ";"):
                decls.append((cur, name, path_attr, inl))
                i = j + 3
                continue
            if _is(after, "{"):
                depth += 1
                child = cur + (name,)
                inline_mods.append(child)
                stack.append((child, inl + (name,), depth))
                i = j + 3
                continue
        if j < n and _is(toks[j], "use", "ident"):
            end = j + 1
            out = []
            end = _parse_use_tree(toks, end, [], out)
            for segs, alias, glob, line in out:
                refs.append(Ref(cur, file, line, segs, "use", alias, glob))
            while end < n and not _is(toks[end], ";"):
                end += 1
            i = end + 1
            continue
        if t.kind == "ident" and t.text in ("crate", "super", "self"):
            prev = toks[i - 1] if i > 0 else None
            nxt = toks[i + 1] if i + 1 < n else None
            if _is(nxt, "::") and not _is(prev, "::"):
                # `pub(in crate::x)` is a visibility, not a reference.
                if not (_is(prev, "in", "ident") and i >= 2 and _is(toks[i - 2], "(")):
                    segs = [t.text]
                    k = i + 1
                    while k + 1 < n and _is(toks[k], "::"):
                        if toks[k + 1].kind == "ident":
                            segs.append(toks[k + 1].text)
                            k += 2
                        elif _is(toks[k + 1], "{"):
                            out = []
                            k = _parse_use_tree(toks, k + 1, segs, out)
                            for s, alias, glob, line in out:
                                refs.append(Ref(cur, file, line, s, "path", None, glob))
                            segs = None
                            break
                        else:
                            break
                    if segs is not None:
                        refs.append(Ref(cur, file, t.line, segs, "path"))
                    i = k
                    continue
        if t.kind == "punct":
            if t.text == "{":
                depth += 1
            elif t.text == "}":
                depth -= 1
                if len(stack) > 1 and depth < stack[-1][2]:
                    stack.pop()
        i += 1
    return decls, inline_mods, refs, test_only


# --------------------------------------------------------------------------
# The crate


def _is_test_file(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    return stem.endswith("_tests")


class Crate:
    def __init__(self, name, root):
        self.name = name
        self.root = os.path.normpath(root)
        self.base = os.path.dirname(self.root)
        self.modules = {}  # module path tuple -> file defining it
        self.children = defaultdict(set)  # module path tuple -> child names
        self.refs = []
        self.missing = []  # (file, module name) of `mod x;` whose file is absent
        self._load(self.root, (), mod_rs=True)

    def rel(self, path):
        return os.path.relpath(path, self.base)

    def _load(self, path, module, mod_rs):
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
        except OSError as e:
            if module == ():
                raise
            self.missing.append((path, str(e)))
            return
        decls, inline_mods, refs, test_only = parse_file(tokenize(src), module, path)
        if test_only:
            return
        self.modules[module] = path
        for m in inline_mods:
            self.modules[m] = path
            self.children[m[:-1]].add(m[-1])
        self.refs.extend(refs)
        file_dir = os.path.dirname(path)
        if mod_rs:
            child_dir = file_dir
        else:
            child_dir = os.path.join(file_dir, os.path.splitext(os.path.basename(path))[0])
        for parent, name, path_attr, inline in decls:
            if path_attr is not None:
                if inline:
                    target = os.path.join(child_dir, *inline, path_attr)
                else:
                    target = os.path.join(file_dir, path_attr)
                child_mod_rs = True
            else:
                d = os.path.join(child_dir, *inline)
                flat = os.path.join(d, name + ".rs")
                nested = os.path.join(d, name, "mod.rs")
                if os.path.exists(flat):
                    target, child_mod_rs = flat, False
                elif os.path.exists(nested):
                    target, child_mod_rs = nested, True
                else:
                    self.missing.append((path, name))
                    continue
            target = os.path.normpath(target)
            if _is_test_file(target):
                continue
            self.children[parent].add(name)
            self._load(target, parent + (name,), child_mod_rs)

    # -- resolution

    def _absolute(self, ref):
        """The path as a tuple from the crate root, or None for an outside path."""
        segs = ref.segs
        cur = ref.module
        if not segs:
            return None
        first = segs[0]
        if first == "crate":
            base, rest = (), segs[1:]
        elif first in ("self", "super"):
            base = cur
            k = 0
            while k < len(segs) and segs[k] in ("self", "super"):
                if segs[k] == "super":
                    base = base[:-1]
                k += 1
            rest = segs[k:]
        elif first in self.children.get(cur, ()):
            base, rest = cur, segs
        else:
            return None
        return base + tuple(s for s in rest if s != "self")

    def _imports(self):
        """Module -> {name: absolute path} for every non-glob `use`."""
        table = defaultdict(dict)
        for ref in self.refs:
            if ref.kind != "use" or ref.glob:
                continue
            path = self._absolute(ref)
            if path is None or not path:
                continue
            name = ref.alias or (ref.segs[-1] if ref.segs[-1] != "self" else path[-1])
            if name == "_":
                continue
            table[ref.module][name] = path
        return table

    def resolve(self, path, imports, seen=None):
        """(deepest module, remaining names) named by an absolute path."""
        mod = ()
        k = 0
        while k < len(path):
            seg = path[k]
            if seg in self.children.get(mod, ()):
                mod = mod + (seg,)
                k += 1
                continue
            # Only the crate root's imports are followed: the root is no node of
            # the graph, while a path through another module's re-export names
            # that module.
            target = imports.get(mod, {}).get(seg) if mod == () else None
            seen = seen or set()
            if target is not None and (mod, seg) not in seen and target != mod + (seg,):
                seen.add((mod, seg))
                return self.resolve(target + path[k + 1 :], imports, seen)
            break
        return mod, path[k:]

    def edges(self):
        """(source top, target top, source file, target file, name) per reference."""
        imports = self._imports()
        out = []
        for ref in self.refs:
            path = self._absolute(ref)
            if path is None:
                continue
            mod, rest = self.resolve(path, imports)
            if not ref.module or not mod:
                continue
            src_top, dst_top = ref.module[0], mod[0]
            if src_top == dst_top:
                continue
            if rest:
                name = "::".join(rest)
            else:
                name = "mod " + "::".join(mod)
            if ref.glob:
                name = "::".join(mod + rest) + "::*"
            out.append((src_top, dst_top, ref.file, self.modules.get(mod, "?"), name))
        return out


# --------------------------------------------------------------------------
# Cycles


def strongly_connected(nodes, succ):
    """Tarjan's algorithm, iterative; components in discovery order."""
    index = {}
    low = {}
    on_stack = set()
    stack = []
    comps = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def shortest_cycle(start, succ, members):
    """A shortest cycle through start inside members, as a list of nodes."""
    prev = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(succ.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


def analyse(crate):
    """The top-level graph's cycles: a list of (members, example, edge lines)."""
    edges = crate.edges()
    succ = defaultdict(set)
    nodes = {m[0] for m in crate.modules if m}
    for src, dst, _, _, _ in edges:
        succ[src].add(dst)
    cycles = []
    for comp in strongly_connected(nodes, succ):
        if len(comp) < 2:
            continue
        members = set(comp)
        tie = defaultdict(set)
        for src, dst, sfile, dfile, name in edges:
            if src in members and dst in members:
                tie[(crate.rel(sfile), crate.rel(dfile))].add(name)
        lines = [f"{s} -> {d}: {', '.join(sorted(names))}" for (s, d), names in sorted(tie.items())]
        cycles.append((comp, shortest_cycle(comp[0], succ, members), lines))
    return cycles


def print_edges(crate, out):
    """Every edge between top-level modules, file -> file: names."""
    tie = defaultdict(set)
    for _, _, sfile, dfile, name in crate.edges():
        tie[(crate.rel(sfile), crate.rel(dfile))].add(name)
    for (s, d), names in sorted(tie.items()):
        print(f"  {s} -> {d}: {', '.join(sorted(names))}", file=out)


def report(name, crate, out, edges=False):
    cycles = analyse(crate)
    tops = sorted({m[0] for m in crate.modules if m})
    print(f"crate {name} ({crate.root}): {len(tops)} top-level modules, {len(set(crate.modules.values()))} files", file=out)
    for path, what in crate.missing:
        print(f"  warning: {crate.rel(path)}: module {what} has no file", file=out)
    if edges:
        print_edges(crate, out)
    if not cycles:
        print("  no cycle", file=out)
        return False
    for k, (comp, example, lines) in enumerate(cycles, 1):
        print(f"  cycle {k}: {len(comp)} modules: {', '.join(comp)}", file=out)
        print(f"    shortest through {comp[0]}: {' -> '.join(example)}", file=out)
        for line in lines:
            print(f"    {line}", file=out)
    return True


# --------------------------------------------------------------------------
# Self-test

SELF_TEST = {
    "cycle": {
        "lib.rs": """
            //! `crate::c` in a doc comment is no reference.
            mod a;
            mod b;
            mod c;
            #[cfg(test)]
            mod tests;
        """,
        "a.rs": """
            use crate::b::Thing;
            pub struct Alpha;
        """,
        "b.rs": """
            pub(crate) use super::c::Gamma as Thing;
        """,
        "c.rs": """
            /* crate::b::Nothing, /* nested */ still a comment */
            pub struct Gamma;
            pub fn make() -> crate::a::Alpha { let _ = "crate::b::x"; crate::a::Alpha }
        """,
        "tests.rs": """
            use crate::c::make;
        """,
    },
    "acyclic": {
        "lib.rs": """
            pub mod a;
            pub mod b;
            pub mod c;
            pub use b::Beta;
        """,
        "a.rs": """
            pub mod inner;
        """,
        "a/inner.rs": """
            pub fn f() -> super::super::b::Beta { crate::Beta }
            pub fn g(x: &'static str) -> char { let _ = r#"crate::a"#; 'x' }
        """,
        "b.rs": """
            pub struct Beta;
            #[cfg(test)]
            mod tests {
                use crate::a::inner::f;
            }
            #[cfg(test)]
            fn helper() { crate::c::d::h(); }
            #[path = "b_tests.rs"]
            mod more;
        """,
        "b_tests.rs": """
            use crate::a::inner::g;
        """,
        "c/mod.rs": """
            #[path = "other.rs"]
            pub mod d;
        """,
        "c/other.rs": """
            pub fn h() { let _ = crate::b::Beta; let _ = self::h; }
        """,
    },
    "grouped": {
        "lib.rs": """
            mod a;
            mod b;
            mod c;
            mod d;
            pub use d::Delta as Reexport;
        """,
        "a.rs": """
            pub struct X;
            pub fn uses() -> crate::Reexport { crate::Reexport }
        """,
        "b.rs": """
            pub struct Y;
            pub struct Z;
        """,
        "c.rs": """
            pub struct W;
        """,
        "d.rs": """
            use crate::{
                a::X,
                b::{Y, Z},
                c::{self, W},
            };
            pub struct Delta;
        """,
    },
}


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        crates = {}
        for name, files in SELF_TEST.items():
            for rel, text in files.items():
                path = os.path.join(tmp, name, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            crates[name] = Crate(name, os.path.join(tmp, name, "lib.rs"))

        def pairs(crate):
            return {(s, d) for s, d, _, _, _ in crate.edges()}

        cyc = analyse(crates["cycle"])
        assert [c[0] for c in cyc] == [["a", "b", "c"]], cyc
        assert pairs(crates["cycle"]) == {("a", "b"), ("b", "c"), ("c", "a")}, pairs(crates["cycle"])
        assert cyc[0][1] == ["a", "b", "c", "a"], cyc[0][1]
        assert ("tests",) not in crates["cycle"].modules

        acyclic = crates["acyclic"]
        assert analyse(acyclic) == [], analyse(acyclic)
        assert pairs(acyclic) == {("a", "b"), ("c", "b")}, pairs(acyclic)
        assert ("c", "d") in acyclic.modules and acyclic.modules[("c", "d")].endswith("other.rs")
        assert ("b", "more") not in acyclic.modules
        assert ("b", "tests") not in acyclic.modules

        grouped = crates["grouped"]
        assert pairs(grouped) == {("a", "d"), ("d", "a"), ("d", "b"), ("d", "c")}, pairs(grouped)
        cyc = analyse(grouped)
        assert [c[0] for c in cyc] == [["a", "d"]], cyc
        names = {n for s, d, _, _, n in grouped.edges() if s == "d"}
        assert names == {"X", "Y", "Z", "mod c", "W"}, names
    print("self-test passed")
    return 0


# --------------------------------------------------------------------------


def main(argv):
    parser = argparse.ArgumentParser(description="Import cycles among a Rust crate's top-level modules.")
    parser.add_argument("--crate", action="append", default=[], metavar="NAME=ROOT", help="a crate by name and root file; repeatable")
    parser.add_argument("--self-test", action="store_true", help="check the checker on synthetic crates")
    parser.add_argument("--edges", action="store_true", help="also print every edge between top-level modules")
    parser.add_argument("roots", nargs="*", metavar="ROOT", help="a crate root file (named after its package directory)")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    crates = []
    for spec in args.crate:
        name, sep, root = spec.partition("=")
        if not sep or not name or not root:
            parser.error(f"--crate wants NAME=ROOT, not {spec!r}")
        crates.append((name, root))
    for root in args.roots:
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(root)))
        crates.append((os.path.basename(pkg), root))
    if not crates:
        parser.error("no crate given")
    found = False
    for name, root in crates:
        try:
            crate = Crate(name, root)
        except OSError as e:
            print(f"modgraph: {root}: {e.strerror}", file=sys.stderr)
            return 2
        found |= report(name, crate, sys.stdout, args.edges)
    return 1 if found else 0


if __name__ == "__main__":
    # Piped into `head`: end quietly when the reader goes.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
