"""`python -m specplan`: prints `specplan.doctor()`."""

import sys

from . import _doctor_main

sys.exit(_doctor_main())
