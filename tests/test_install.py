"""`make venv`'s installer (infra/install.py) gives uv the indexes, wheel folders, constraints and
certificate pip is configured with, environment variables over files as in pip."""

from infra.install import pip_options, uv_arguments

LISTING = """\
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/old-wheels'
install.timeout='30'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
:env:.disable-pip-version-check='1'
"""


def test_pip_configuration_becomes_the_same_uv_flags():
    options = pip_options(LISTING)
    assert options["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over pip.conf
    args, env = uv_arguments(options)
    assert args == [
        "--extra-index-url",
        "file:///opt/a/simple",
        "--extra-index-url",
        "file:///opt/b/simple",
        "--find-links",
        "/opt/wheels",
        "--constraint",
        "/etc/pip/constraints.txt",
    ]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt", "UV_HTTP_TIMEOUT": "180"}


def test_no_pip_configuration_gives_uv_its_defaults():
    assert uv_arguments(pip_options("")) == ([], {})
    args, _ = uv_arguments(pip_options("global.no-index='true'\nglobal.index-url='file:///x'"))
    assert args == ["--index-url", "file:///x", "--no-index"]
