"""Settings for every test."""

from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase

# Examples are kept in memory: the tests may run as a user who cannot write
# to the checkout (after a root run of `make test`), and hypothesis's default
# on-disk database would then only warn, which the test settings make an error.
settings.register_profile("mtrace-live", database=InMemoryExampleDatabase())
settings.load_profile("mtrace-live")
