"""What a generation server can do, asked once when it is provisioned and kept in its handle
(:attr:`grpo_steps.servers.base.GenerationServer.capabilities`): every client built from the handle (the training
process's, evaluation's) answers from it without a request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerCapabilities:
    """``transfer_engine``: the server (every replica) loads pushed weights through the pipeline's weight-transfer
    engine (:data:`grpo_steps.weights.server_flags.WEIGHT_TRANSFER_BACKEND`); ``token_route``: it answers the
    token-in/token-out route (:data:`grpo_steps.weights.server_flags.TOKEN_GENERATE_PATH`)."""

    transfer_engine: bool
    token_route: bool

    @property
    def in_flight(self) -> bool:
        """Whether a push may update the server under requests in flight: it needs both (the engine loads while
        requests are frozen, the token route says which weight version sampled each token).

        >>> ServerCapabilities(True, True).in_flight, ServerCapabilities(True, False).in_flight
        (True, False)
        """
        return self.transfer_engine and self.token_route

    @classmethod
    def from_record(cls, record: ServerCapabilities | dict | None) -> ServerCapabilities | None:
        """The capabilities of a handle's record (:meth:`~grpo_steps.servers.base.GenerationServer.to_dict` writes a
        dict); None for an empty one (a handle recorded before capabilities existed, or of a server that could not
        answer: its clients then ask). A record of an older pipeline, which named the engine ``weight_engine``, is
        read too.

        >>> ServerCapabilities.from_record({"weight_engine": True, "token_route": False, "in_flight_updates": False})
        ServerCapabilities(transfer_engine=True, token_route=False)
        """
        if not record or isinstance(record, ServerCapabilities):
            return record or None
        engine = record.get("transfer_engine", record.get("weight_engine"))
        return cls(transfer_engine=bool(engine), token_route=bool(record["token_route"]))
