"""A batched top-down renderer of the push scene's primitive geoms, in torch.

Orthographic, looking down -z, one sample at each pixel's centre, in the tabletop's colours: the
grey table, the four goal discs, the objects' outlines (turned by their heading), the
end-effector disc on top. Each camera is a fixed :class:`~flashrt_gym.sims.push.task.View` of the table: the whole table
``[-1, 1]^2`` with row 0 at its top (+y) is ``top``, the policies' one camera so far; a
policy that reads several cameras (pi0 reads three) gets several fixed views of the same scene.
It needs no OpenGL, runs on any torch device and is a fixed sequence of tensor ops with no host
synchronisation, so it can be recorded in a captured CUDA graph with the rest of a step.
"""

from __future__ import annotations

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
            }
        return self._consts[device]

    def __call__(
        self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The images of end-effectors (slots, 2), object positions (slots, K, 2) and headings
        (slots, K) from every view, written into ``out`` ((slots, views, H, W, 3) uint8) when
        given. Each pixel gets a label (table, goal, object k, end-effector; later ones drawn over
        earlier ones), then its colour from the palette."""
        c = self.constants(ee.device)
        n, size, views = ee.shape[0], self.image_size, len(self.views)
        want = (n, views, size, size, 3)
        if out is not None and (tuple(out.shape) != want or out.dtype != torch.uint8):
            raise ValueError(f"render: out must be {want} uint8, got {tuple(out.shape)} {out.dtype}")
        ee, obj, yaw = ee.float(), obj.float(), yaw.float()
        px, py = c["px"], c["py"]
        label = c["base"].expand(n, views, size, size)
        cos, sin = torch.cos(yaw)[:, :, None, None, None], torch.sin(yaw)[:, :, None, None, None]
        for k, fp in enumerate(self.footprints):
            o = obj[:, k, :, None, None, None]
            dx, dy = px - o[:, 0], py - o[:, 1]  # (N, C, H, W), table frame
            if fp.kind == "circle":
                inside = dx * dx + dy * dy < fp.radius * fp.radius
            else:  # into the body frame, then inside every edge of the counter-clockwise outline
                bx = dx * cos[:, k] + dy * sin[:, k]
                by = -dx * sin[:, k] + dy * cos[:, k]
                inside = None
                for (vx, vy), (wx, wy) in zip(fp.vertices, fp.vertices[1:] + fp.vertices[:1], strict=True):
                    side = (wx - vx) * (by - vy) - (wy - vy) * (bx - vx) > 0
                    inside = side if inside is None else inside & side
            label = torch.where(inside, 2 + k, label)
        dx, dy = px - ee[:, 0, None, None, None], py - ee[:, 1, None, None, None]
        label = torch.where(dx * dx + dy * dy < self.ee_radius * self.ee_radius, 2 + len(self.footprints), label)
        img = c["palette"][label]
        return img if out is None else out.copy_(img)
