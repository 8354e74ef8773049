"""A hypothesis state machine drives one ``SaslServer`` with random SASL_AUTH/SASL_STEP
messages: random bytes, mutations and truncations of well-formed messages made without
the password, and replays of a genuine exchange recorded on another connection. The
server answers only with the documented statuses, never raises, and never authenticates;
a genuine exchange started at any point still succeeds (it is not merely stuck)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dcp.protocol.opcodes import Status
from dcp.protocol.sasl import SCRAM_MECHANISMS, SaslClient, SaslServer, make_credentials

PASSWORD = "correct horse"
CREDS = {m: make_credentials(m, PASSWORD, iterations=64) for m in SCRAM_MECHANISMS}
USERS = ("alice", "bob")
STATUSES = {Status.SUCCESS, Status.AUTH_CONTINUE, Status.AUTH_ERROR, Status.EINVAL}
MECHS = st.sampled_from([*SCRAM_MECHANISMS, "PLAIN", "SCRAM-SHA1", "", "scram-sha512"])


def lookup(name: str, mechanism: str):
    return CREDS.get(mechanism) if name == "alice" else None


def _recorded() -> list[tuple[str, bytes]]:
    """A genuine exchange per SCRAM mechanism, overheard on another connection."""
    out = []
    for mech in SCRAM_MECHANISMS:
        other = SaslServer(lookup)
        client = SaslClient(mech, "alice", PASSWORD)
        first = client.start()
        final = client.step(other.start(mech, first).value)
        assert other.step(mech, final).status == Status.SUCCESS
        out += [(mech, first), (mech, final)]
    return out


RECORDED = _recorded()


class SaslMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.server = SaslServer(lookup, allow_plain=True)
        self.client: SaslClient | None = None  # a wrong-password client mid-exchange
        self.last_challenge = b""

    def _check(self, result) -> None:
        assert result.status in STATUSES, result
        assert result.status != Status.SUCCESS, f"authenticated without the password: {result}"
        assert result.username is None
        if result.status == Status.AUTH_CONTINUE:
            self.last_challenge = result.value

    @rule(mech=MECHS, data=st.binary(max_size=1500))
    def auth_random(self, mech, data):
        self._check(self.server.start(mech, data))

    @rule(mech=MECHS, data=st.binary(max_size=300))
    def step_random(self, mech, data):
        self._check(self.server.step(mech, data))

    @rule(
        mech=st.sampled_from(list(SCRAM_MECHANISMS)),
        user=st.sampled_from(USERS),
        password=st.text(max_size=20).filter(lambda p: p != PASSWORD),
    )
    def auth_wrong_password(self, mech, user, password):
        self.client = SaslClient(mech, user, password)
        self._check(self.server.start(mech, self.client.start()))

    @precondition(lambda self: self.client is not None and self.last_challenge)
    @rule(cut=st.integers(min_value=0, max_value=400), junk=st.binary(max_size=8))
    def step_wrong_password(self, cut, junk):
        assert self.client is not None
        try:
            final = self.client.step(self.last_challenge)
        except Exception:  # a challenge for another client: send anything
            final = b"c=biws,r=x,p=AAAA"
        variants = (final, final[:cut], final[:cut] + junk + final[cut:])
        for message in variants:
            self._check(self.server.step(self.client.mechanism, message))

    @rule(index=st.integers(min_value=0, max_value=len(RECORDED) - 1), cut=st.integers(0, 200))
    def replay_recorded(self, index, cut):
        mech, message = RECORDED[index]
        send = self.server.start if index % 2 == 0 else self.server.step
        self._check(send(mech, message))
        self._check(self.server.step(mech, message[:cut]))

    @rule(user=st.sampled_from(USERS), password=st.binary(max_size=40))
    def plain_wrong(self, user, password):
        if password == PASSWORD.encode():
            return
        self._check(self.server.start("PLAIN", b"\0" + user.encode() + b"\0" + password))

    @invariant()
    def a_genuine_exchange_still_works(self):
        client = SaslClient("SCRAM-SHA256", "alice", PASSWORD)
        # the machine's own server, through a fresh exchange: state left over must not
        # prevent (or fake) a genuine login; it ends this exchange only
        first = self.server.start("SCRAM-SHA256", client.start())
        assert first.status == Status.AUTH_CONTINUE
        final = self.server.step("SCRAM-SHA256", client.step(first.value))
        assert (final.status, final.username) == (Status.SUCCESS, "alice")
        client.finish(final.value)
        self.client, self.last_challenge = None, b""


SaslMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
TestSaslStateMachine = SaslMachine.TestCase
