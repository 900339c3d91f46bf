"""The one error type a user sees: a single `error:` line naming file, tensor, rank and numbers."""


class K3Error(Exception):
    """A user error (bad checkpoint, topology, preflight refusal, bad override): printed as one `error:` line."""

    def __init__(self, message: str, agreed: bool = False, peers_alive: bool = False):
        super().__init__(" ".join(str(message).split()))  # always one line
        self.agreed = agreed  # every rank raised this same error together (from an agreement)
        self.peers_alive = peers_alive  # after a published failure: the peers live and print it too (wait for them)

    @property
    def line(self) -> str:
        return f"error: {self}"
