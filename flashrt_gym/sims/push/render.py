"""A batched top-down renderer of the push scene's primitive geoms, in torch.

Orthographic, looking down -z, one sample at each pixel's centre, in the tabletop's colours: the
grey table, the four goal discs, the objects' outlines (turned by their heading), the
end-effector disc on top. Each camera is a fixed :class:`~flashrt_gym.sims.push.task.View` of the table: the whole table
``[-1, 1]^2`` with row 0 at its top (+y) is ``top``, the policies' one camera so far; a
policy that reads several cameras (pi0 reads three) gets several fixed views of the same scene.
It needs no OpenGL, runs on any torch device and is a fixed sequence of tensor ops with no host
synchronisation, so it can be recorded in a captured CUDA graph with the rest of a step.

An object or the end-effector covers a few pixels of the image (the tabletop's objects, 0.12
table units across at most, span about 8 of 64 pixels), so each is drawn in a square window of
pixels around it that holds every pixel its outline can reach, not over the whole image: the
same per-pixel arithmetic on the pixels gathered there, so the same labels bit for bit, at a
fraction of the work (a handful of passes over the image instead of some seventy at 4 096 slots).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flashrt_gym.sims.push.task import VIEWS, Footprint, View


class TopDownRenderer:
    """Renders ``(slots, views, H, W, 3)`` uint8 images from positions.

    Args:
        footprints: each object's outline (body frame).
        colors: each object's RGB colour (0-255).
        goals: (G, 2) goal centres; goal_radius: their radius.
        ee_radius: the end-effector disc's radius.
        image_size: side of the square image.
        background, goal_color, ee_color: RGB colours (0-255).
        views: the cameras, in the order of the images' camera axis (default: ``top`` alone).
    """

    def __init__(
        self,
        footprints: Sequence[Footprint],
        colors: Sequence[tuple[int, int, int]],
        goals: Sequence[tuple[float, float]],
        goal_radius: float,
        ee_radius: float,
        image_size: int,
        background: tuple[int, int, int],
        goal_color: tuple[int, int, int],
        ee_color: tuple[int, int, int],
        views: Sequence[View] = (VIEWS["top"],),
    ) -> None:
        if len(footprints) != len(colors):
            raise ValueError(f"one colour per object: {len(footprints)} footprints, {len(colors)} colours")
        if not views or any(v.half_extent <= 0 for v in views):
            raise ValueError(f"at least one view, each of positive half_extent, got {views}")
        self.footprints, self.image_size, self.views = tuple(footprints), int(image_size), tuple(views)
        self.goal_radius, self.ee_radius = float(goal_radius), float(ee_radius)
        self._host = {
            "colors": torch.tensor(colors, dtype=torch.float32),
            "goals": torch.tensor(goals, dtype=torch.float32),
            "background": torch.tensor(background, dtype=torch.float32),
            "goal_color": torch.tensor(goal_color, dtype=torch.float32),
            "ee_color": torch.tensor(ee_color, dtype=torch.float32),
        }
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}

    def constants(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The renderer's constant tensors on ``device`` (made at the first call: an in-graph
        simulator makes them when it binds, so that no capture copies them in)."""
        if device not in self._consts:
            n = self.image_size
            lin = (torch.arange(n, dtype=torch.float32) + 0.5) / n * 2 - 1
            ys, xs = torch.meshgrid(-lin, lin, indexing="ij")  # (H, W) in the view's frame
            v = torch.tensor([[*w.centre, w.half_extent, w.yaw] for w in self.views], dtype=torch.float64)
            cx, cy, half, turn = (v[:, i, None, None] for i in range(4))
            cos, sin = torch.cos(turn), torch.sin(turn)  # the top view maps each pixel to itself, exactly
            xs, ys = (cx + half * (xs * cos - ys * sin)).float(), (cy + half * (xs * sin + ys * cos)).float()
            h = self._host
            goals = h["goals"]
            goal_mask = ((xs - goals[:, 0, None, None, None]) ** 2 + (ys - goals[:, 1, None, None, None]) ** 2).sqrt()
            goal_mask = (goal_mask < self.goal_radius).any(0)  # the goal discs do not move: one (C, H, W) mask
            palette = torch.cat([h["background"][None], h["goal_color"][None], h["colors"], h["ee_color"][None]])
            self._consts[device] = {
                "px": xs.to(device),  # (C, H, W) table coordinates of the pixel centres
                "py": ys.to(device),
                "base": goal_mask.long().to(device),  # (C, H, W) label 0 table, 1 goal
                "palette": palette.to(torch.uint8).to(device),  # by label: table, goal, objects, end-effector
                # (C, 5): centre x, centre y, half extent, cosine and sine of the yaw (for the windows)
                "view": torch.cat([v[:, :3], cos[:, 0, 0, None], sin[:, 0, 0, None]], 1).float().to(device),
            }
        return self._consts[device]

    def window(self, radius: float) -> int:
        """Side in pixels of the square window drawn around a shape that reaches ``radius`` table
        units from its centre: its widest extent in the view of the smallest half extent, and a
        pixel of margin on each side for the rounding of the window's corner (at most the image)."""
        reach = radius / min(v.half_extent for v in self.views) * self.image_size / 2
        return min(self.image_size, math.ceil(2 * reach) + 3)

    def _pixels(self, c: dict[str, torch.Tensor], centre: torch.Tensor, side: int) -> torch.Tensor:
        """(slots, views, side * side) flat pixel indices of the ``side``-pixel window of each view
        around table points ``centre`` (slots, 2), row by row: its corner is the pixel a half
        side up and left of the point's pixel, moved inside the image where the point is near
        an edge or off the image (where a window that reaches past the edge would be)."""
        n = self.image_size
        cx, cy, half, cos, sin = c["view"].unbind(1)
        dx, dy = centre[:, 0, None] - cx, centre[:, 1, None] - cy  # (slots, views)
        col = ((dx * cos + dy * sin) / half + 1) * (n / 2) - 0.5  # the point in the view's pixels
        row = (1 - (-dx * sin + dy * cos) / half) * (n / 2) - 0.5
        corner = torch.stack([row, col]) - (side - 1) / 2
        # a non-finite point (a diverged world) takes the image's first window: nothing is inside
        corner = torch.nan_to_num(corner, nan=0.0, posinf=0.0, neginf=0.0).round().clamp(0, n - side).long()
        steps = torch.arange(side, device=centre.device)
        rows = corner[0, :, :, None, None] + steps[:, None]
        cols = corner[1, :, :, None, None] + steps[None, :]
        return (rows * n + cols).flatten(2)

    def _inside(self, k: int, dx: torch.Tensor, dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Whether each pixel centre, at ``dx, dy`` (table frame) from shape ``k``'s centre, is
        inside it: object ``k`` turned by its heading (``cos, sin``), or the end-effector disc for
        ``k`` past the objects."""
        if k == len(self.footprints):
            return dx * dx + dy * dy < self.ee_radius * self.ee_radius
        fp = self.footprints[k]
        if fp.kind == "circle":
            return dx * dx + dy * dy < fp.radius * fp.radius
        bx = dx * cos + dy * sin  # into the body frame, then inside every edge of the counter-clockwise outline
        by = -dx * sin + dy * cos
        inside = None
        for (vx, vy), (wx, wy) in zip(fp.vertices, fp.vertices[1:] + fp.vertices[:1], strict=True):
            side = (wx - vx) * (by - vy) - (wy - vy) * (bx - vx) > 0
            inside = side if inside is None else inside & side
        return inside

    def _shapes(self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor) -> list:
        """Each shape in drawing order (the objects, then the end-effector): its centre (slots, 2),
        the cosine and sine of its heading (slots, 1, 1, 1), and the radius its outline reaches."""
        cos, sin = torch.cos(yaw.float())[:, :, None, None, None], torch.sin(yaw.float())[:, :, None, None, None]
        ee, obj = ee.float(), obj.float()
        shapes = [(obj[:, k], cos[:, k], sin[:, k], fp.radius) for k, fp in enumerate(self.footprints)]
        return [*shapes, (ee, None, None, self.ee_radius)]

    def _out(self, label: torch.Tensor, out: torch.Tensor | None, c: dict[str, torch.Tensor]) -> torch.Tensor:
        n, views, size = label.shape[0], len(self.views), self.image_size
        want = (n, views, size, size, 3)
        if out is not None and (tuple(out.shape) != want or out.dtype != torch.uint8):
            raise ValueError(f"render: out must be {want} uint8, got {tuple(out.shape)} {out.dtype}")
        img = c["palette"][label.view(n, views, size, size)]
        return img if out is None else out.copy_(img)

    def __call__(
        self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The images of end-effectors (slots, 2), object positions (slots, K, 2) and headings
        (slots, K) from every view, written into ``out`` ((slots, views, H, W, 3) uint8) when
        given. Each pixel gets a label (table, goal, object k, end-effector; later ones drawn over
        earlier ones), then its colour from the palette. Each shape is drawn in its window
        (:meth:`window`); :meth:`reference` draws over the whole image, to the same bytes.

        Raises:
            ValueError: ``out`` of another shape or dtype.
        """
        c = self.constants(ee.device)
        n, views = ee.shape[0], len(self.views)
        px, py = c["px"].flatten(1).expand(n, -1, -1), c["py"].flatten(1).expand(n, -1, -1)  # (N, C, H*W)
        label = c["base"].flatten(1).expand(n, -1, -1).clone()
        for k, (centre, cos, sin, reach) in enumerate(self._shapes(ee, obj, yaw)):
            side = self.window(reach)
            at = self._pixels(c, centre, side)
            dx = px.gather(2, at).view(n, views, side, side) - centre[:, 0, None, None, None]
            dy = py.gather(2, at).view(n, views, side, side) - centre[:, 1, None, None, None]
            inside = self._inside(k, dx, dy, cos, sin).flatten(2)
            label.scatter_(2, at, torch.where(inside, 2 + k, label.gather(2, at)))
        return self._out(label, out, c)

    def reference(
        self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`__call__` with every shape tested at every pixel of the image: what the windows
        must reproduce (tests), and the renderer before them."""
        c = self.constants(ee.device)
        n, views, size = ee.shape[0], len(self.views), self.image_size
        label = c["base"].expand(n, views, size, size)
        for k, (centre, cos, sin, _) in enumerate(self._shapes(ee, obj, yaw)):
            dx = c["px"] - centre[:, 0, None, None, None]  # (N, C, H, W), table frame
            dy = c["py"] - centre[:, 1, None, None, None]
            label = torch.where(self._inside(k, dx, dy, cos, sin), 2 + k, label)
        return self._out(label, out, c)
