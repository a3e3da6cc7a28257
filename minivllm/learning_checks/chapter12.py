"""Chapter 12's learning check: int4 group-wise weight quantization.

A weight matrix stored in 4 bits has 16 levels per number, too few for one range per row: a
row's few large weights would leave its small ones all on one level. So each run of
`group_size` weights along a row (a group) gets its own range, from its own minimum to its own
maximum, in 15 steps of scale = (maximum - minimum) / 15: the weight w becomes the level
q = round((w - minimum) / scale) in 0..15, and dequantizes to q * scale + minimum, at most half
a step from w. A group whose weights are all equal has no range (scale 0): any scale with q = 0
gives it back exactly, w = minimum.

The second check packs the levels as llama.cpp's Q4_1 blocks hold them, two a byte: the 32
levels of a block in 16 bytes, byte j holding level j in its low nibble and level j + 16 in its
high one (not neighbours 2j and 2j + 1, the order most people guess first).
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, show_values

LEVELS = 15  # 16 levels, 0..15: 15 steps between a group's minimum and its maximum


def _our_quantize_int4():
    from minivllm.models.quantization import dequantize_int4
    from minivllm.models.quantization import quantize_int4 as ours

    def quantize_int4(weight: torch.Tensor, group_size: int):
        q, scale, minimum = ours(weight, group_size)
        return q, scale, minimum, dequantize_int4(q, scale, minimum, group_size)

    return quantize_int4


# How a drawn group's weights look: spread around 0, all negative, all positive, or all equal;
# each group at its own magnitude, so that groups of one row have very different ranges.
KINDS = ["mixed", "negative", "positive", "constant"]
MAGNITUDES = [1.0, 1e-3, 100.0, 0.1]


@st.composite
def int4_weights(draw):
    """(weight [rows, groups * group_size] float32, group_size)."""
    group_size = draw(st.sampled_from([4, 8, 32]))
    rows = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 4))
    kind = st.tuples(st.sampled_from(KINDS), st.sampled_from(MAGNITUDES))
    kinds = draw(st.lists(kind, min_size=rows * num_groups, max_size=rows * num_groups))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    groups = []
    for name, magnitude in kinds:
        noise = torch.randn(group_size, generator=generator)
        spread = torch.rand(group_size, generator=generator) + 0.5  # 0.5..1.5
        group = {
            "mixed": noise,
            "negative": -spread,
            "positive": spread,
            "constant": noise[:1].expand(group_size),
        }[name]
        groups.append(group * magnitude)
    weight = torch.stack(groups).reshape(rows, num_groups * group_size).float()
    return weight, group_size


def _group(row: int, group: int, group_size: int) -> str:
    first = group * group_size
    return f"row {row}, group {group} (columns {first}..{first + group_size - 1})"


@learning_check(
    "ch12.quantize_int4",
    # The interface only: the rule (how many steps, how a weight picks its level) is the
    # exercise, and the failure messages name it once an attempt is off.
    signature="quantize_int4(weight: Tensor[N, K] float32, group_size: int) -> (q: Tensor[N, K] "
    "levels 0..15, scale: Tensor[N, K // group_size], minimum: (same), dequantized: Tensor[N, "
    "K]); each run of group_size weights along a row is a group with its own minimum and scale, "
    "and dequantized = q * scale + minimum of the weight's group",
    reference=_our_quantize_int4,
)
def check_quantize_int4(quantize_int4) -> None:
    """q holds whole levels 0..15; dequantized is q * scale + minimum; each non-constant group's
    minimum is its own minimum and its scale its own (maximum - minimum) / 15; every weight
    dequantizes to within half a step of itself, a constant group's to itself."""

    @check_settings(max_examples=60)
    @given(case=int4_weights())
    # Two groups whose ranges are 100x apart: one range for the row (or the whole matrix) would
    # put the small group's four weights on two levels.
    @example(case=(torch.tensor([[-0.3, -0.1, 0.1, 0.3, -30.0, -10.0, 10.0, 30.0]]), 4))
    # The maximum lands on level 15 exactly (2.4 / 0.2 = 12, 1.0 -> 3.0 / 0.2 = 15).
    @example(case=(torch.tensor([[-2.0, -1.0, 0.4, 1.0]]), 4))
    # A constant group (its scale would be 0) next to a group of negative weights only.
    @example(case=(torch.tensor([[0.5, 0.5, 0.5, 0.5, -4.0, -3.0, -2.5, -1.0]]), 4))
    def property_(case):
        weight, group_size = case
        rows, columns = weight.shape
        num_groups = columns // group_size
        returned = quantize_int4(weight.clone(), group_size)
        assert isinstance(returned, (tuple, list)) and len(returned) == 4, (
            f"returned {type(returned).__name__}; expected four tensors "
            "(q, scale, minimum, dequantized)"
        )
        q, scale, minimum, dequantized = (torch.as_tensor(part) for part in returned)

        # a) shapes, and q's values: whole levels 0..15.
        for name, got, expected in [
            ("q", q, (rows, columns)),
            ("scale", scale, (rows, num_groups)),
            ("minimum", minimum, (rows, num_groups)),
            ("dequantized", dequantized, (rows, columns)),
        ]:
            assert tuple(got.shape) == expected, (
                f"{name} has shape {tuple(got.shape)}, expected {expected} for a weight "
                f"[{rows}, {columns}] in groups of {group_size} ({num_groups} per row)"
            )
        levels = q.double()
        wrong = ~torch.isfinite(levels) | (levels != levels.round()) | (levels < 0)
        wrong |= levels > LEVELS
        if wrong.any():
            row, column = wrong.nonzero()[0].tolist()
            value = levels[row, column].item()
            hint = " (a scale of 0 in a constant group?)" if value != value else ""
            raise AssertionError(
                f"q[{row}, {column}] = {value:g}{hint}, in "
                f"{_group(row, column // group_size, group_size)}: q holds the levels 0..15, "
                f"whole numbers (q[{row}] = {show_values(levels[row])})"
            )

        w = weight.double().reshape(rows, num_groups, group_size)
        levels = levels.reshape(rows, num_groups, group_size)
        scale, minimum = scale.double(), minimum.double()
        got = dequantized.double().reshape(rows, num_groups, group_size)
        size = w.abs().amax(-1)  # [rows, groups]: each group's magnitude, for the tolerances

        # b) the learner's dequantization is the scheme's, q * scale + minimum.
        expected = levels * scale[..., None] + minimum[..., None]
        tolerance = 1e-5 * (size + LEVELS * scale.abs() + minimum.abs())[..., None] + 1e-12
        wrong = ~((got - expected).abs() <= tolerance)
        if wrong.any():
            row, group, i = wrong.nonzero()[0].tolist()
            raise AssertionError(
                f"your dequantization does not follow the scheme: in "
                f"{_group(row, group, group_size)}, weight {group * group_size + i} has "
                f"q = {levels[row, group, i].item():g}, and the group's scale = "
                f"{scale[row, group].item():.6g}, minimum = {minimum[row, group].item():.6g}, "
                f"so q * scale + minimum = {expected[row, group, i].item():.6g}; your "
                f"dequantized = {got[row, group, i].item():.6g}"
            )

        # c) each non-constant group: its own minimum, and its own range in 15 steps.
        low, high = w.amin(-1), w.amax(-1)
        constant = high == low
        wrong = ~((minimum - low).abs() <= 1e-5 * size + 1e-12) & ~constant
        if wrong.any():
            row, group = wrong.nonzero()[0].tolist()
            raise AssertionError(
                f"{_group(row, group, group_size)} = {show_values(w[row, group])}: minimum = "
                f"{minimum[row, group].item():.6g}, expected the group's own minimum "
                f"{low[row, group].item():.6g}; each group of {group_size} weights along a "
                "row has its own minimum and scale, not one for the whole row or matrix"
            )
        step = (high - low) / LEVELS
        wrong = ~((scale - step).abs() <= 1e-5 * step + 1e-6 * size) & ~constant
        if wrong.any():
            row, group = wrong.nonzero()[0].tolist()
            got_scale = scale[row, group].item()
            hint = ""
            if abs(got_scale * (LEVELS + 1) - (high - low)[row, group].item()) <= (
                1e-5 * (high - low)[row, group].item()
            ):
                hint = " (yours is (maximum - minimum) / 16: 16 levels are 15 steps apart)"
            raise AssertionError(
                f"{_group(row, group, group_size)} = {show_values(w[row, group])}: scale = "
                f"{got_scale:.6g}, expected the group's own (maximum - minimum) / 15 = "
                f"({high[row, group].item():.6g} - {low[row, group].item():.6g}) / 15 = "
                f"{step[row, group].item():.6g}{hint}; each group of {group_size} weights "
                "along a row has its own minimum and scale, not one for the whole row or matrix"
            )

        # d) every weight within half a step of its dequantized value; a constant group exact.
        error = (w - got).abs()
        half_step = step[..., None] / 2 * (1 + 1e-4) + 1e-5 * size[..., None]
        exact = 1e-6 * size[..., None] + 1e-12
        wrong = ~(error <= torch.where(constant[..., None], exact, half_step))
        if wrong.any():
            row, group, i = wrong.nonzero()[0].tolist()
            column = group * group_size + i
            if constant[row, group]:
                raise AssertionError(
                    f"{_group(row, group, group_size)} is constant (every weight "
                    f"{low[row, group].item():.6g}) but weight {column} dequantizes to "
                    f"{got[row, group, i].item():.6g}: its maximum - minimum is 0, so a scale "
                    "of (maximum - minimum) / 15 is 0; use any other scale (1) and q = 0, so "
                    "that it dequantizes to its minimum, the weight itself"
                )
            nearest = ((w - low[..., None]) / step[..., None]).round().clamp(0, LEVELS)
            raise AssertionError(
                f"{_group(row, group, group_size)} = {show_values(w[row, group])}: weight "
                f"[{row}, {column}] = {w[row, group, i].item():.6g} has q = "
                f"{levels[row, group, i].item():g} and dequantizes to "
                f"{got[row, group, i].item():.6g}, {error[row, group, i].item():.3g} away: more "
                f"than half a step (scale / 2 = {step[row, group].item() / 2:.3g}); the "
                f"nearest level is {nearest[row, group, i].item():g}: q = round((w - minimum) "
                "/ scale), not floor, clamped to 0..15"
            )

    property_()


@st.composite
def int4_levels(draw):
    """Levels [rows, blocks * 32] of 0..15, uint8."""
    rows, blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randint(0, 16, (rows, blocks * 32), generator=generator, dtype=torch.uint8)


def _our_pack_q4_1():
    from minivllm.models.cpu_quantized import pack_int4_blocks

    return pack_int4_blocks


def _byte_of(row: int, column: int) -> str:
    block, j = divmod(column, 16)
    return f"row {row}, byte {column} (block {block}, byte {j} of its 16)"


@learning_check(
    "ch12.pack_q4_1",
    signature="pack_q4_1(q: Tensor[N, K] uint8 levels 0..15, K a multiple of 32) -> Tensor[N, "
    "K // 2] uint8: each block of 32 levels along a row in 16 bytes, byte j holding level j "
    "in its low 4 bits and level j + 16 in its high 4 bits",
    reference=_our_pack_q4_1,
)
def check_pack_q4_1(pack_q4_1) -> None:
    """Every byte of every block holds the two levels Q4_1 puts there, low nibble first."""

    @check_settings(max_examples=40)
    @given(q=int4_levels())
    # One block of levels 0..15 then 15..0: every byte's two nibbles differ, and so do any two
    # neighbours, so any other order shows at once.
    @example(q=torch.cat([torch.arange(16), 15 - torch.arange(16)]).to(torch.uint8)[None])
    def property_(q):
        rows, columns = q.shape
        packed = torch.as_tensor(pack_q4_1(q.clone()))
        assert tuple(packed.shape) == (rows, columns // 2), (
            f"packed has shape {tuple(packed.shape)}, expected {(rows, columns // 2)}: two "
            f"levels a byte for q [{rows}, {columns}]"
        )
        packed = packed.to(torch.int64)
        assert ((packed >= 0) & (packed <= 255)).all(), "packed must hold bytes, 0..255"
        low, high = packed & 15, packed >> 4
        blocks_of_q = q.to(torch.int64).reshape(rows, -1, 2, 16)  # [row, block, half, j]
        expected_low = blocks_of_q[:, :, 0].reshape(rows, -1)
        expected_high = blocks_of_q[:, :, 1].reshape(rows, -1)
        wrong = (low != expected_low) | (high != expected_high)
        if wrong.any():
            row, column = wrong.nonzero()[0].tolist()
            block, j = divmod(column, 16)
            first = block * 32
            hint = ""
            if (
                low[row, column] == q[row, first + 2 * j]
                and high[row, column] == q[row, first + 2 * j + 1]
            ):
                hint = " (yours packs neighbours 2j and 2j + 1 together)"
            elif low[row, column] == expected_high[row, column]:
                hint = " (yours puts level j + 16 in the low nibble: the low 4 bits hold level j)"
            raise AssertionError(
                f"{_byte_of(row, column)} is {packed[row, column].item():#04x}: low nibble "
                f"{low[row, column].item()}, high nibble {high[row, column].item()}; Q4_1 puts "
                f"level {first + j} (= {expected_low[row, column].item()}) in the low 4 bits and "
                f"level {first + j + 16} (= {expected_high[row, column].item()}) in the high 4 "
                f"bits{hint}"
            )

    property_()
