"""The reference's arithmetic problems: "a * b = " (or "a + b = ") after a three-line few-shot prefix."""
from __future__ import annotations

import random

from lssp.errors import UserError

FEW_SHOT = "8 * 12 = 96\n25 * 4 = 100\n37 * 85 = 3145\n"  # the reference's prefix
OPERATIONS = {  # symbol, the few-shot prefix in the reference's shape, the result
    "mul": ("*", FEW_SHOT, lambda a, b: a * b),
    "add": ("+", "8 + 12 = 20\n25 + 4 = 29\n37 + 85 = 122\n", lambda a, b: a + b),
}
LOW, HIGH = 1, 99  # operands, both inclusive (the reference drew 1..98 while its README said 1..99)


def multiplication_problems(n: int, seed: int, high: int = HIGH) -> list[tuple[int, int]]:
    """``n`` operand pairs drawn uniformly from LOW..``high`` (the draws do not depend on the operation)."""
    rng = random.Random(seed)
    return [(rng.randint(LOW, high), rng.randint(LOW, high)) for _ in range(n)]


def few_shot(op: str = "mul") -> str:
    if op not in OPERATIONS:
        raise UserError(f"--op {op!r}: expected one of {', '.join(OPERATIONS)}")
    return OPERATIONS[op][1]


def prompt_for(a: int, b: int, op: str = "mul") -> str:
    return f"{few_shot(op)}{a} {OPERATIONS[op][0]} {b} = "


def answer_for(a: int, b: int, op: str = "mul") -> int:
    return OPERATIONS[op][2](a, b)


def parse_answer(completion: str) -> int | None:
    """The first line of the completion as an integer, or None."""
    first = completion.split("\n", 1)[0].strip().replace(",", "")
    try:
        return int(first)
    except ValueError:
        return None
