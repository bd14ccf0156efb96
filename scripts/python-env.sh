# Sourced by scripts/test and .ci/run: pick the Python the tests run under.
# Inside an active virtualenv, that one; otherwise the project's own .venv,
# created on first use, so the system's Python is never changed.
if [ -n "${VIRTUAL_ENV:-}" ]; then
    py="$VIRTUAL_ENV/bin/python"
else
    if [ ! -x .venv/bin/python ]; then
        echo "scripts/test: creating the project virtualenv in .venv (once)" >&2
        python3 -m venv .venv
    fi
    py="$PWD/.venv/bin/python"
    export VIRTUAL_ENV="$PWD/.venv"
    export PATH="$VIRTUAL_ENV/bin:$PATH"
fi
# Spark's Python workers run this interpreter too, not whatever python3 is on PATH.
export PYSPARK_PYTHON="${PYSPARK_PYTHON:-$py}"
export PYSPARK_DRIVER_PYTHON="${PYSPARK_DRIVER_PYTHON:-$py}"
