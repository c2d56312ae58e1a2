"""Which global rank of a ps job is which worker and which server.

The launcher numbers ranks node by node: node n holds ranks n*P .. n*P + P - 1, with
P = workers per node + servers per node. On every node the first ranks are its workers
and the last ones its servers, so `--servers K` on N nodes puts K/N servers on each
host's CPU and every worker pushes to and pulls from servers on every host (as the
classic parameter server spreads its servers over the machines). On one node this is
workers 0..W-1 and servers W..W+K-1. Worker 0 is always global rank 0 (it writes the
checkpoints and the metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import Config


@dataclass(frozen=True)
class Roles:
    """The ps layout of a job.

    Attributes:
        nodes: machines N.
        workers_per_node: `--nproc`.
        servers_per_node: `--servers` / N.
    """

    nodes: int
    workers_per_node: int
    servers_per_node: int

    @classmethod
    def of(cls, config: Config) -> Roles:
        """The layout `config` launches (the launcher checked that N divides K)."""
        return cls(config.nnodes, config.nproc, config.servers // config.nnodes)

    @property
    def per_node(self) -> int:
        """Processes on each machine."""
        return self.workers_per_node + self.servers_per_node

    @property
    def world_size(self) -> int:
        """Processes of the whole job."""
        return self.nodes * self.per_node

    @property
    def workers(self) -> int:
        """W, the workers of the job."""
        return self.nodes * self.workers_per_node

    @property
    def servers(self) -> int:
        """K, the servers of the job."""
        return self.nodes * self.servers_per_node

    def worker_rank(self, index: int) -> int:
        """The global rank of worker `index` (in [0, W))."""
        node, local = divmod(index, self.workers_per_node)
        return node * self.per_node + local

    def server_rank(self, index: int) -> int:
        """The global rank of server `index` (in [0, K))."""
        node, local = divmod(index, self.servers_per_node)
        return node * self.per_node + self.workers_per_node + local

    @property
    def worker_ranks(self) -> list[int]:
        """The global ranks of workers 0..W-1."""
        return [self.worker_rank(w) for w in range(self.workers)]

    @property
    def server_ranks(self) -> list[int]:
        """The global ranks of servers 0..K-1."""
        return [self.server_rank(s) for s in range(self.servers)]

    def is_server(self, rank: int) -> bool:
        """Whether global `rank` is a server."""
        return rank % self.per_node >= self.workers_per_node

    def name(self, rank: int) -> str:
        """What global `rank` is, by index: "worker 1", "server 0"."""
        return f"{'server' if self.is_server(rank) else 'worker'} {self.index(rank)}"

    def index(self, rank: int) -> int:
        """Global `rank`'s index among the workers, or among the servers if it is one."""
        node, local = divmod(rank, self.per_node)
        if local < self.workers_per_node:
            return node * self.workers_per_node + local
        return node * self.servers_per_node + local - self.workers_per_node
