"""The order an epoch reads its chunks in: a keyed permutation of [0, n), computed per index.

`data.shuffle` picks the kind; a run records the kind it trained with (TrainState.shuffle), so a
resume reads the stream it started, whatever today's default:

- `feistel` (a new run's default): an 8-round unbalanced Feistel network on the m = ceil(log2 n)
  bit strings (the two halves are ceil(m/2) and floor(m/2) bits; each round swaps them), with
  cycle-walking: an index whose image lands in [n, 2^m) is mapped again until it lands below n,
  which keeps a bijection of [0, n) (2^m < 2n, so fewer than 2 evaluations on average). No array
  of size n exists anywhere: position 2^40 costs what position 0 costs, in memory and time.
  The round function is a 64-bit finaliser (SplitMix64's, a bijection whose every input bit
  flips each output bit with probability near 1/2) of the half XOR a round key; the round keys
  come from numpy's SeedSequence of (seed, epoch[, domain]). A weak round function (an LCG) is
  what left "unshuffled-looking" structure in another trainer's stream: the tests measure the
  avalanche and the displacement against a true random permutation.
- `block`: Levanter's hierarchical block shuffle, for read locality. The chunks are cut into
  blocks of B consecutive chunks (consecutive text of a shard); the blocks are permuted (Feistel),
  and within each window of W permuted blocks the W*B chunks are permuted again (Feistel keyed
  by the window). A batch then reads from about W blocks at a time: a reader that fetches a block
  whole does 1/B reads per example, at the cost of mixing only within a window.
- `array`: what dsslm did before: numpy's PCG64 permutation of all n chunks, materialised (n int64s
  per epoch, per domain, on every rank). Kept, exactly, so runs saved with it resume bit for bit.
"""
from __future__ import annotations

import numpy as np

ROUNDS = 8
KINDS = ("feistel", "block", "array")
_SALT = 0x7065726D  # "perm": keeps these keys apart from the mixture's block permutations
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic: numpy arrays do not warn)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def round_keys(entropy: list[int]) -> np.ndarray:
    """ROUNDS 64-bit keys from integers (seed, epoch, ...), as numpy's SeedSequence spreads them."""
    return np.random.SeedSequence([*entropy, _SALT]).generate_state(ROUNDS, np.uint64)


class Feistel:
    """A keyed bijection of [0, n): `at` maps positions to indices, `inverse` indices back."""

    kind = "feistel"

    def __init__(self, n: int, keys: np.ndarray):
        if n < 1:
            raise ValueError(f"a permutation of [0, {n}) is empty")
        self.n, self.keys = int(n), np.asarray(keys, dtype=np.uint64)
        # At least 2 bits, so both halves have one; n = 1 is the identity (see at).
        self.bits = max(2, (self.n - 1).bit_length())
        if self.bits > 62:
            raise ValueError(f"n = {n} is beyond 2^62")
        self.left = self.bits - self.bits // 2  # the high half's width in the first round

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The index each position reads (int64 array, positions in [0, n))."""
        x = np.asarray(positions, dtype=np.int64)
        if self.n == 1:
            return np.zeros_like(x)
        y = self._walk(x.astype(np.uint64), self._forward)
        return y.astype(np.int64)

    def inverse(self, indices: np.ndarray) -> np.ndarray:
        """The position at which each index is read: at(inverse(i)) == i."""
        x = np.asarray(indices, dtype=np.int64)
        if self.n == 1:
            return np.zeros_like(x)
        return self._walk(x.astype(np.uint64), self._backward).astype(np.int64)

    def _walk(self, x: np.ndarray, step) -> np.ndarray:
        # Cycle-walking: the bijection of [0, 2^bits) restricted to [0, n) by following each
        # element's cycle until it is back below n (it must be: its cycle holds its start).
        y = step(x)
        out = y >= np.uint64(self.n)
        while out.any():
            y[out] = step(y[out])
            out = y >= np.uint64(self.n)
        return y

    def _forward(self, x: np.ndarray) -> np.ndarray:
        wl, wr = self.left, self.bits - self.left  # x = L (wl bits) . R (wr bits)
        for k in self.keys:
            right = x & np.uint64((1 << wr) - 1)
            left = x >> np.uint64(wr)
            f = _mix(right * _GOLDEN ^ k) >> np.uint64(64 - wl)  # the best-mixed high bits, wl of them
            x = (right << np.uint64(wl)) | (left ^ f)
            wl, wr = wr, wl
        return x

    def _backward(self, y: np.ndarray) -> np.ndarray:
        # The widths after r rounds: (left, right) swaps each round.
        wl, wr = self.left, self.bits - self.left
        if len(self.keys) % 2:
            wl, wr = wr, wl
        for k in self.keys[::-1]:
            # y = R (wr' = the old right's width) . (L ^ F(R)) (the old left's width)
            old_left_w, old_right_w = wr, wl
            right = y >> np.uint64(old_left_w)
            left = (y & np.uint64((1 << old_left_w) - 1)) ^ (_mix(right * _GOLDEN ^ k) >> np.uint64(64 - old_left_w))
            y = (left << np.uint64(old_right_w)) | right
            wl, wr = old_left_w, old_right_w
        return y


class BlockShuffle:
    """Blocks of `block` consecutive indices permuted, then indices permuted within each window of
    `window` blocks: a bijection of [0, n) that reads about `window` blocks per window of positions."""

    kind = "block"

    def __init__(self, n: int, entropy: list[int], block: int, window: int):
        if n < 1 or block < 1 or window < 1:
            raise ValueError(f"a block shuffle of n={n}, block={block}, window={window} needs all >= 1")
        self.n, self.block, self.window = int(n), int(block), int(window)
        self.n_blocks = -(-self.n // self.block)
        self.padded = self.n_blocks * self.block  # the last block is short: cycle-walked past
        self.entropy = list(entropy)
        self.blocks = Feistel(self.n_blocks, round_keys(self.entropy))
        self._windows: dict[int, Feistel] = {}  # a few windows' orders (the prefetch thread reads beside)

    def at(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.int64)
        y = self._forward(x)
        out = y >= self.n
        while out.any():  # a position on the short block's padding: follow its cycle (see Feistel)
            y[out] = self._forward(y[out])
            out = y >= self.n
        return y

    def _window(self, w: int, size: int) -> Feistel:
        """Window w's order, its keys derived once: a step maps its positions more than once (its
        read, the skip list's test, a replay's), and SeedSequence's derivation of a window's keys
        costs more than mapping a step's positions in it."""
        order = self._windows.get(w)
        if order is None:
            order = Feistel(size, round_keys([*self.entropy, 1 + w]))
            self._windows = {**dict(list(self._windows.items())[-7:]), w: order}  # the last few, replaced whole
        return order

    def _forward(self, x: np.ndarray) -> np.ndarray:
        span = self.window * self.block
        windows, offsets = np.divmod(x, span)
        y = np.empty_like(x)
        for w in np.unique(windows):  # a step's positions lie in one window or two
            mask = windows == w
            size = min(span, self.padded - int(w) * span)  # the last window holds fewer blocks
            inner = self._window(int(w), size).at(offsets[mask])
            slot = int(w) * self.window + inner // self.block
            y[mask] = self.blocks.at(slot) * self.block + inner % self.block
        return y


class ArrayOrder:
    """numpy's PCG64 permutation of [0, n) seeded by `entropy`, materialised: the `array` kind."""

    kind = "array"

    def __init__(self, n: int, entropy: list[int]):
        self.n = int(n)
        self.table = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))).permutation(self.n)

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(positions, dtype=np.int64)]


def parse_shuffle(spec: str) -> tuple[str, int, int]:
    """(kind, block, window) of a recorded kind: 'feistel', 'array' or 'block/B/W'."""
    kind, *rest = spec.split("/")
    if kind == "block" and len(rest) == 2 and all(r.isdigit() and int(r) > 0 for r in rest):
        return kind, int(rest[0]), int(rest[1])
    if kind in ("feistel", "array") and not rest:
        return kind, 0, 0
    raise ValueError(f"data shuffle {spec!r} is not feistel, array or block/B/W")


def order_of(spec: str, n: int, entropy: list[int]):
    """The order of one epoch (of one domain) of n chunks under the recorded kind `spec`.

    `array` seeds numpy with `entropy` itself, as dsslm always did, so its streams are unchanged."""
    kind, block, window = parse_shuffle(spec)
    if kind == "array":
        return ArrayOrder(n, entropy)
    if kind == "block":
        return BlockShuffle(n, entropy, block, window)
    return Feistel(n, round_keys(entropy))
