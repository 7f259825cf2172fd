"""The layering of python/open_vc_attn, read with `ast` (no import, no torch): no import cycle between its
modules, no module using another module's private (_underscore) names, every custom op registered at
import of its module (never inside a function), and the constants the extension owns not re-typed."""
import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "open_vc_attn"
NAME = "open_vc_attn"


def modules():
    """{dotted module name: parsed tree} of every .py file of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = (NAME, *path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (ast.parse(path.read_text(), str(path)), path.name == "__init__.py")
    return out


MODULES = modules()


def resolve(module, is_package, node):
    """The absolute module of an ImportFrom node (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))   # dunders are public


def imports(module):
    """(target module, names bound from it or None, alias bindings) of every import in `module`, at any
    depth (function-level imports count too: they are edges all the same)."""
    tree, is_package = MODULES[module]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((a.name, None, {(a.asname or a.name.split(".")[0]): a.name}))
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, is_package, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:   # `from . import x` of a submodule: an edge to the submodule itself
                    out.append((sub, None, {a.asname or a.name: sub}))
                else:
                    out.append((target, a.name, {}))
    return out


def test_every_module_is_parsed():
    assert {"open_vc_attn.api", "open_vc_attn._checks", "open_vc_attn.ops", "open_vc_attn.ops.fp8",
            "open_vc_attn.ops.repair", "open_vc_attn.ops.vc"} <= set(MODULES)
    assert "open_vc_attn._vc_ops" not in MODULES   # the ops are one package now


def test_no_import_cycle():
    graph = {m: sorted({t for t, _, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            cycle = stack[stack.index(m):] + [m]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if m in done:
            return
        stack.append(m)
        for t in graph[m]:
            visit(t)
        stack.pop()
        done.add(m)

    for m in graph:
        visit(m)
    for op_module in ("open_vc_attn.ops.fp8", "open_vc_attn.ops.repair", "open_vc_attn.ops.vc"):
        assert "open_vc_attn.api" not in graph[op_module]   # api -> ops, never back


def test_no_private_name_crosses_a_module():
    bad = []
    for m in MODULES:
        tree, _ = MODULES[m]
        aliases = {}
        for target, name, bound in imports(m):
            if target.startswith(NAME) and name is not None and private(name):
                bad.append(f"{m}: from {target} import {name}")
            aliases.update({k: v for k, v in bound.items() if v.startswith(NAME)})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and private(node.attr) and f"{aliases[node.value.id]}.{node.attr}" not in MODULES:
                bad.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_custom_ops_registered_at_module_level_only():
    """torch.library.custom_op (and register_fake) at a module's top level, never inside a function: a
    registration that runs on first use breaks torch.compile(fullgraph=True) when it is the first call."""
    found = []
    for m, (tree, _) in MODULES.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in (n for stmt in fn.body for n in ast.walk(stmt)):   # decorators excluded
                    if isinstance(node, ast.Attribute) and node.attr in ("custom_op", "define", "impl") \
                            and isinstance(node.value, ast.Attribute) and node.value.attr == "library":
                        found.append(f"{m}:{node.lineno}")
                    if isinstance(node, ast.Attribute) and node.attr == "register_fake":
                        found.append(f"{m}:{node.lineno}")
    assert not found, "custom ops registered inside functions: " + ", ".join(found)


def test_no_literal_mid_window_default():
    """mid_window_blocks defaults are _layout.DEFAULT_MID_WINDOW_BLOCKS (the extension's value, checked below), not
    a literal."""
    literal = []
    for m, (tree, _) in MODULES.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = fn.args.args + fn.args.kwonlyargs
                defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + list(fn.args.defaults) \
                    + list(fn.args.kw_defaults)
                for a, d in zip(args, defaults):
                    if a.arg == "mid_window_blocks" and isinstance(d, ast.Constant) and d.value is not None:
                        literal.append(f"{m}.{fn.name}")
    assert not literal, "literal mid_window_blocks defaults: " + ", ".join(literal)


def test_importing_the_package_does_not_load_the_extension():
    """import open_vc_attn (and its API module) loads neither libopenvc nor torch: the import stays cheap
    and works without the extension. A fresh interpreter shows what the import loads."""
    import subprocess
    import sys
    code = ("import sys, open_vc_attn, open_vc_attn.api, open_vc_attn._checks, open_vc_attn.masks; "
            "print('open_vc_attn._openvc_ext' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], out


def test_layout_constants_match_the_extension():
    from open_vc_attn import _ext, _layout
    ext = _ext.load()
    assert _layout.DEFAULT_MID_WINDOW_BLOCKS == ext.DEFAULT_MID_WINDOW_BLOCKS == ext.AttentionParams().mid_window_blocks
    assert _layout.QUANT_BLOCK == ext.QUANT_BLOCK and _layout.KERNEL_HEAD_DIM == ext.KERNEL_HEAD_DIM
    assert _layout.NATURAL_ORDER == ext.NATURAL_ORDER == -1
    assert _layout.INT8_KEY_GROUPS == ext.INT8_KEY_GROUPS == 8
    assert {name for name in _layout.QK_FORMATS} == {"e4m3", "int8"}
    assert all(hasattr(ext.QkFormat, name) for name in _layout.QK_FORMATS)   # the ops pass QkFormat.<name>
    order = tuple(ext.PACKED_KEY_ORDER)
    assert tuple(_layout.PACKED_KEY_ORDER) == order
    assert all(order[c] == k for k, c in enumerate(_layout.packed_columns()))


def test_p_formats_match_the_extension():
    """_layout.P_FORMATS mirrors _openvc_ext.PFormat (the ops pass PFormat.<name>), and AttentionParams'
    default is expcast. Skips with an extension built before the P format (openvc::PFormat)."""
    from open_vc_attn import _ext, _layout
    ext = _ext.load()
    assert _layout.P_FORMATS == ("expcast", "exp2")
    if not hasattr(ext, "PFormat"):
        pytest.skip("_openvc_ext has no PFormat (an extension built before openvc::PFormat)")
    assert all(hasattr(ext.PFormat, name) for name in _layout.P_FORMATS)
    assert ext.AttentionParams().p_format == getattr(ext.PFormat, _layout.P_FORMATS[0])


def test_importing_ops_registers_every_op():
    """A fresh process: `import open_vc_attn.ops` alone registers all eleven ops (none waits for a first call)."""
    pytest.importorskip("torch")
    code = ("import torch, open_vc_attn.ops as ops\n"
            "names = ['attention', 'prepare_fp8', 'attention_fp8', 'prepare_v_repair', 'build_v_repair',\n"
            "         'attention_fp8_repair', 'vc_grouping', 'prepare_vc', 'attention_vc_fp8', 'rotary_pairs_',\n"
            "         'rotary_pairs_out']\n"
            "has = torch._C._dispatch_has_kernel_for_dispatch_key\n"
            "missing = [n for n in names if not has('open_vc_attn::' + n, 'CUDA')]\n"
            "assert not missing, missing\n"
            "assert all(getattr(ops, n + '_op') is getattr(torch.ops.open_vc_attn, n).default for n in names)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
