"""The catalogue of bad inputs run by `benchmarks/bad_inputs.py`.

One module per family of inputs (`times`, `states`, `controllers`, `meshes`,
`files`, `ensembles`, `fitting`), each with a `*_cases()` function returning its
[`Case`][]s; `case` defines a case and classifies its outcome, `runner` runs the
cases and reports. Importing the package turns on float64 (`jax_enable_x64`),
before any of its modules creates an array.
"""

import jax


jax.config.update("jax_enable_x64", True)
