"""A batched top-down renderer of the push scene's primitive geoms, in torch.

Orthographic, looking down -z at the table ``[-1, 1]^2`` (row 0 is the top of the table, +y),
one sample at each pixel's centre, in the tabletop's colours: the grey table, the four goal
discs, the objects' outlines (turned by their heading), the end-effector disc on top. It needs
no OpenGL, runs on any torch device and is a fixed sequence of tensor ops with no host
synchronisation, so it can be recorded in a captured CUDA graph with the rest of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashrt_gym.sims.push import Footprint


class TopDownRenderer:
    """Renders ``(slots, H, W, 3)`` uint8 images from positions.

    Args:
        footprints: each object's outline (body frame).
        colors: each object's RGB colour (0-255).
        goals: (G, 2) goal centres; goal_radius: their radius.
        ee_radius: the end-effector disc's radius.
        image_size: side of the square image.
        background, goal_color, ee_color: RGB colours (0-255).
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
    ) -> None:
        if len(footprints) != len(colors):
            raise ValueError(f"one colour per object: {len(footprints)} footprints, {len(colors)} colours")
        self.footprints, self.image_size = tuple(footprints), int(image_size)
        self.goal_radius, self.ee_radius = float(goal_radius), float(ee_radius)
        self._host = {
            "colors": torch.tensor(colors, dtype=torch.float32),
            "goals": torch.tensor(goals, dtype=torch.float32),
            "background": torch.tensor(background, dtype=torch.float32),
            "goal_color": torch.tensor(goal_color, dtype=torch.float32),
            "ee_color": torch.tensor(ee_color, dtype=torch.float32),
        }
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _c(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._consts:
            n = self.image_size
            lin = (torch.arange(n, dtype=torch.float32) + 0.5) / n * 2 - 1
            ys, xs = torch.meshgrid(-lin, lin, indexing="ij")
            c = {k: v.to(device) for k, v in self._host.items()}
            c["pix"] = torch.stack([xs, ys], -1).to(device)  # (H, W, 2)
            # the goal discs do not move: one (H, W) mask
            c["goal_mask"] = ((c["pix"][None] - c["goals"][:, None, None]).norm(dim=-1) < self.goal_radius).any(0)
            for k, fp in enumerate(self.footprints):
                if fp.kind == "polygon":
                    v = torch.tensor(fp.vertices, dtype=torch.float32, device=device)
                    edge = torch.roll(v, -1, dims=0) - v
                    c[f"poly{k}"] = torch.stack([v, edge], 0)  # (2, V, 2)
            self._consts[device] = c
        return self._consts[device]

    def __call__(
        self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The images of end-effectors (slots, 2), object positions (slots, K, 2) and headings
        (slots, K), written into ``out`` ((slots, H, W, 3) uint8) when given."""
        c = self._c(ee.device)
        n, size = ee.shape[0], self.image_size
        if out is not None and (tuple(out.shape) != (n, size, size, 3) or out.dtype != torch.uint8):
            raise ValueError(f"render: out must be ({n}, {size}, {size}, 3) uint8, got {tuple(out.shape)} {out.dtype}")
        ee, obj, yaw = ee.float(), obj.float(), yaw.float()
        pix = c["pix"]
        img = torch.where(c["goal_mask"][None, :, :, None], c["goal_color"], c["background"]).expand(n, size, size, 3)
        cos, sin = torch.cos(yaw)[:, :, None, None], torch.sin(yaw)[:, :, None, None]
        for k, fp in enumerate(self.footprints):
            d = pix[None] - obj[:, k][:, None, None]  # (N, H, W, 2) in the table frame
            if fp.kind == "circle":
                inside = (d * d).sum(-1) < fp.radius * fp.radius
            else:  # into the body frame, then inside every edge of the counter-clockwise outline
                bx = d[..., 0] * cos[:, k] + d[..., 1] * sin[:, k]
                by = -d[..., 0] * sin[:, k] + d[..., 1] * cos[:, k]
                v, e = c[f"poly{k}"]
                cross = e[:, 0] * (by[..., None] - v[:, 1]) - e[:, 1] * (bx[..., None] - v[:, 0])
                inside = (cross > 0).all(-1)
            img = torch.where(inside[..., None], c["colors"][k], img)
        d = pix[None] - ee[:, None, None]
        img = torch.where(((d * d).sum(-1) < self.ee_radius * self.ee_radius)[..., None], c["ee_color"], img)
        img = img.to(torch.uint8)
        return img if out is None else out.copy_(img)
