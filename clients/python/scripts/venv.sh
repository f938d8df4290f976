# Sourced (not run) by the test scripts of the Python client and of the examples built on it,
# from the folder that is to hold the virtualenv: makes .venv there with $PYTHON (python3 by
# default) unless it exists, upgrades its pip, and sets `venv` (its path) and `pip` (an array:
# that virtualenv's pip, quiet).
python="${PYTHON:-python3}"
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
