"""The nodes of cel-cpp's checked expression (:mod:`.gen.checked_ast_pb2`, which the cost estimator
reads too), for the libraries that act on the compiled tree: the regex library's check of literal
patterns and the format library's optional results."""

from __future__ import annotations

from collections.abc import Iterator

from gpudra_operator.cel.gen import checked_ast_pb2 as ast


def children(expr: ast.Expr) -> Iterator[ast.Expr]:
    kind = expr.WhichOneof("expr_kind")
    if kind == "select_expr":
        yield expr.select_expr.operand
    elif kind == "call_expr":
        if expr.call_expr.HasField("target"):
            yield expr.call_expr.target
        yield from expr.call_expr.args
    elif kind == "list_expr":
        yield from expr.list_expr.elements
    elif kind == "struct_expr":
        for entry in expr.struct_expr.entries:
            if entry.HasField("map_key"):
                yield entry.map_key
            yield entry.value
    elif kind == "comprehension_expr":
        comprehension = expr.comprehension_expr
        yield from (comprehension.iter_range, comprehension.accu_init, comprehension.loop_condition,
                    comprehension.loop_step, comprehension.result)


def nodes(expr: ast.Expr) -> Iterator[ast.Expr]:
    """Every node, children before their parent (so a parent may be rewritten after them)."""
    for child in children(expr):
        yield from nodes(child)
    yield expr


def string_constant(expr: ast.Expr) -> str | None:
    """The value of a string literal node, else None."""
    if expr.WhichOneof("expr_kind") == "const_expr" and expr.const_expr.WhichOneof("constant_kind") == "string_value":
        return expr.const_expr.string_value
    return None
