"""The guest scripts, rendered as argv lists.

Every script is constant POSIX ``sh`` text (tested under dash and busybox
``sh``); every variable part is passed as a positional argument, never spliced
into the text.  Transports that need one command string join the argv with
:func:`shlex.join`, so each value is quoted exactly once, by ``shlex.quote``.

The staging root is private to the pulling user (issue 7, item 1): by default
``/tmp/wsync-UID``, computed in the guest; the probe creates it (umask 077)
and refuses it, before anything else is written, when it overlaps the
workspace (a usage error, exit 2) or when it is a symlink, not owned by the
user, writable by group or others, or lies beneath a directory that someone
other than root or the user could change (OpenSSH StrictModes; a staging
failure, exit 5, naming the path and its owner).  Every later call uses the
physical path the probe answered.  Only a producer that hashes to what the
host expects is ever run, and a pid read back from staging is killed only when
it is a process of this user running the producer (checked in ``/proc``).

Layout in the guest (``ROOT`` is the staging root, outside the workspace)::

    ROOT/.producer-HASH.sh  the producer script, checked against its hash before every run

    ROOT/SNAPSHOT/launch/   admission token: whoever creates it starts the producer;
                            ``launch/size`` holds the workspace size and the free
                            space measured at admission (KiB), for a full disk's message
    ROOT/SNAPSHOT/pid.launch  the pid of the latest launch (the producer, once detached)
    ROOT/SNAPSHOT/lock.N/pid  generation N's claim: the one producer that writes the
                            snapshot (see the producer); a launched snapshot with no
                            live producer and no result is launched again (generation N+1)
    ROOT/SNAPSHOT/pid       the pid of the producer holding the latest claim
    ROOT/SNAPSHOT/data      the compressed tar stream, append-only
    ROOT/SNAPSHOT/index     one line per chunk, appended only after the chunk
                            is in ``data`` and hashed: ``C seq offset length hash``
    ROOT/SNAPSHOT/isize     the index's size in bytes, rewritten after each line: a
                            hint that lets a status long poll look without a fork
    ROOT/SNAPSHOT/done      written atomically (tmp + mv) when the stream is
                            complete: chunks, length, whole-stream hash, and
                            the exit status of tar and of the compressor
    ROOT/SNAPSHOT/failed    written instead of ``done`` on any failed step;
                            ``disk-full KB: ...`` when the disk was full then

Every write in the producer is checked; a failed write ends in ``failed``,
never in ``done`` (field report 3, finding 1).  Every script's answer is an
envelope (see :mod:`wsync.protocol.envelope`).  With ``gate=1`` a script first
waits for one line on stdin, which the transport sends only once it is
attached, so nothing is printed before the host is listening.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import re
import shlex
import urllib.parse
from collections.abc import Sequence
from typing import TypedDict

from wsync.errors import UsageError
from wsync.protocol.hashing import ALGORITHMS, PROBE_INPUT
from wsync.protocol.producer import _PRODUCER, KILL_FNS, LSN, PID_CHECKS, STATUS_FN

#: snapshot ids are ours, but they become guest paths: keep them boring
SNAPSHOT_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")

#: reads and chunks are aligned to this; ``dd`` works in these blocks
BLOCK = 64 * 1024

_PRELUDE = (
    r"""
set -u
# byte semantics in the shell itself: ${#var} counts bytes, not a UTF-8 locale's
# characters (bash and busybox take this without an export; dash always counts bytes;
# yash does not, which emit minds): the status's index tail is measured so
LC_ALL=C
exec 2>/dev/null
g=$1 nonce=$2 hid=$3 enc=$4
shift 4
if [ "$g" = 1 ]; then IFS= read -r _ || :; fi
h() {
  case $hid in
    xxh128) xxhsum -H2 ;;
    b2) b2sum ;;
    sha256) sha256sum ;;
    md5) md5sum || echo - ;;
    *) cat >/dev/null; echo - ;;
  esac
}
# the answer's length, without a fork where it is printable ASCII and newlines (every
# shell counts those in bytes); other bytes go through wc: dash, bash and busybox would
# count them in bytes too under LC_ALL=C, but yash counts characters (it decoded its
# arguments at start)
emit() {
  case $2 in *[!"$nl"\ -~]*) n=$(printf %s "$2" | wc -c) ;; *) n=${#2} ;; esac
  dg=$(printf '%s' "$2" | h)
  printf 'WSYNC1 BEGIN %s %s %s %s\n' "$nonce" "$1" $((n+0)) "$enc"
  if [ "$enc" = b64 ]; then printf '%s' "$2" | base64; else printf '%s' "$2"; fi
  printf '\nWSYNC1 END %s %s\n' "$nonce" "${dg%% *}"
}
expand_home() {
  case $1 in
    "~") printf '%s' "$HOME" ;;
    "~/"*) printf '%s/%s' "$HOME" "${1#"~/"}" ;;
    *) printf '%s' "$1" ;;
  esac
}
nl='
'
"""
    + LSN
    + PID_CHECKS
)

_STAGE = r"""
me=$(id -u)
no() { emit err "$1"; exit 0; }
cdp() {
  case $1 in /*) ;; *) set -- "./$1" ;; esac
  cd -P "$1" && pwd -P
}
over() {
  a=${1%/}/ b=${wp%/}/
  case $a in "$b"*) no "inside${nl}$1${nl}$wp" ;; esac
  case $b in "$a"*) no "inside${nl}$1${nl}$wp" ;; esac
}
chain() {
  x=$1
  while :; do
    lsn "${x:-/}"
    case $u in 0|"$me") ;; *) no "ancestor $u $m${nl}${x:-/}" ;; esac
    case $m in ?????w*|????????w*) case $m in ?????????[tT]*) ;; *) no "ancestor $u $m${nl}${x:-/}" ;; esac ;; esac
    [ -n "$x" ] || break
    x=${x%/*}
  done
}
# the staging root: private to this user, outside the workspace, its physical
# path in R.  Nothing is created before the overlap check; ancestors are
# checked like OpenSSH's StrictModes (root's or ours, writable only if sticky)
stage() {
  unset CDPATH
  r=$1
  [ "$r" = - ] && r=/tmp/wsync-$me
  r=$(expand_home "$r")
  wp=$(cdp "$2") || no "workspace-missing"
  e=$r t=
  while [ -n "$e" ] && [ ! -e "$e" ] && [ ! -L "$e" ]; do t=/${e##*/}$t; e=${e%/*}; done
  ep=$(cdp "${e:-/}") || no "notdir${nl}${e:-/}"
  over "${ep%/}$t"
  [ -z "$t" ] || chain "$ep"
  umask 077
  mkdir -p "$r" || no "create${nl}$r"
  [ -L "$r" ] && no "symlink${nl}$r"
  R=$(cdp "$r") || no "notdir${nl}$r"
  over "$R"
  lsn "$R"
  [ "$u" = "$me" ] || no "owner $u $me $(ls -ld "$R" | awk '{print $3}')${nl}$R"
  case $m in d*) ;; *) no "notdir${nl}$R" ;; esac
  case $m in ?????w*|????????w*) no "writable $m${nl}$R" ;; esac
  chain "$R"
}
"""

_PROBE = r"""
ws=$(expand_home "$1")
p="proto 1${nl}uid $me"
if [ -d "$ws" ]; then
  if [ -r "$ws" ] && [ -x "$ws" ]; then w=dir; else w=unreadable; fi
elif [ -e "$ws" ]; then w=notdir; else w=missing; fi
p="$p${nl}workspace $w"
for t in tar zstd gzip xxhsum b2sum sha256sum setsid base64 dd wc find ls du id stat readlink xargs; do
  if command -v "$t" >/dev/null 2>&1; then p="$p${nl}has_$t 1"; else p="$p${nl}has_$t 0"; fi
done
x=$(printf wsync-probe | xxhsum -H2)
p="$p${nl}test_xxh128 $x"
# the other hash tools only where xxhsum does not answer the digest the host expects
if [ "${x%% *}" != "$3" ]; then
  p="$p${nl}test_b2 $(printf wsync-probe | b2sum)"
  p="$p${nl}test_sha256 $(printf wsync-probe | sha256sum)"
fi
if [ "$(printf abcdef | dd bs=65536 iflag=skip_bytes,count_bytes skip=2 count=3 2>/dev/null)" = cde ]; then
  p="$p${nl}has_dd_bytes 1"
fi
# zstd 1.3.2+ matches across 32 MiB (--long=25): a fifth fewer bytes for source trees
printf x | zstd -q -c --long=25 >/dev/null 2>&1 && p="$p${nl}has_zstd_long 1"
v=$(tar --version 2>&1)
p="$p${nl}tar_version ${v%%"$nl"*}"
find / -maxdepth 0 -printf '' >/dev/null 2>&1 && p="$p${nl}has_find_printf 1"
if [ "$w" = dir ] && command -v ls >/dev/null 2>&1 && command -v id >/dev/null 2>&1; then
  stage "$2" "$ws"
  p="$p${nl}stage_root $R"
  # the free space only where it is shown (wsync doctor): the admission measures its own
  [ "$4" = 1 ] && p="$p${nl}stage_free_kb $(df -Pk "$R" | awk 'NR == 2 { print $4 }')"
fi
emit ok "$p"
"""

_KILL = "\nme=$(id -u)\n" + KILL_FNS

_ADMIT_HEAD = r"""
me=$(id -u)
no() { emit err "$1"; exit 0; }
root=$1 id=$2 ws=$(expand_home "$3") cs=$4 comp=$5 ttl=$6 pn=$7 prod=$1/$7 run=$8 ph=$9 mode=${10}
"""
_ADMIT_ARGS = r"""
n=${11}
shift 11
"""
#: (its status's looks and inline bound come before the producer's arguments)
_ADMIT_STATUS_ARGS = r"""
n=${11} sw=${12} sil=${13}
shift 13
"""
_ADMIT = r"""
# the listed size: digits, or none ("-")
n=${n%%[!0-9]*}
# the probe checked the root and its ancestors; make sure it is still that
lsn "$root"
[ "$(cd -P "$root" && pwd -P)" = "$root" ] && [ "$u" = "$me" ] || no unsafe-root
case $m in ?????w*|????????w*) no unsafe-root ;; esac
[ -d "$ws" ] || no workspace-missing
# run only the producer whose hash the host expects (else it is reinstalled)
dg=$(h < "$prod")
[ -f "$prod" ] && [ "${dg%% *}" = "$ph" ] || no producer-missing
umask 077
# stale snapshots go first (the producer's --gc, hashed above: see there)
sh "$prod" --gc "$root" "$id" "$ttl" "$pn"
d=$root/$id f=
if [ ! -d "$d/launch" ] && [ "$mode" = select ] && [ ! -f "$d/list" ]; then
  no list-missing
fi
if [ ! -d "$d/launch" ] && [ "$mode" = tar ]; then
  # refuse what cannot fit even at 4x compression, before starting anything.  The
  # size the host's listing gave (n, KiB of file bytes) admits at once; where there is
  # none, or it does not fit, du's decides (sparse files take fewer blocks than bytes),
  # bounded: a retried admission must not walk a huge cold tree forever
  f=$(df -Pk "$root" | awk 'NR == 2 { print $4 + 0 }')
  full() { [ -n "$n" ] && [ -n "$f" ] && [ $((f*4)) -lt $((n+256)) ]; }
  if [ -z "$n" ] || full; then
    t=
    command -v timeout >/dev/null && t="timeout 20"
    n=$($t du -sk "$ws")
    n=${n%%[!0-9]*}
    full && no "disk-full $f $n"
  fi
fi
mkdir -p "$d" || no mkdir-failed
# nothing runs for a launched snapshot and nothing came of it: the admission that
# launched was killed before its producer detached, or the producer died.  A launch
# that may still be starting counts as running (and the producer's claim keeps a
# second one from running anyway: see the producer)
# Liveness first, then the records: a producer writes its record before it exits, so
# one found gone has left its record for the look after (the other order let a
# producer finish between the two looks and be launched again)
idle() {
  g=1
  while [ -d "$d/lock.$g" ]; do g=$((g+1)); done
  for k in pid.launch pid "lock.$((g-1))/pid"; do rd "$d/$k"; busy "$v_" && return 1; done
  [ -f "$d/done" ] || [ -f "$d/failed" ] && return 1
  return 0
}
a=reconciled go=1
if mkdir "$d/launch"; then
  printf '%s %s' "$n" "$f" > "$d/launch/size"
elif [ ! -d "$d/launch" ]; then
  no token-failed
elif ! idle; then
  go=
  rd "$d/launch/by"
  [ "$v_" = "$run" ] && a=admitted
fi
if [ "$go" ]; then
  # launched, or launched again (a new stream: "admitted" even if another run began
  # it); who launched: a retry of this very run (its answer was lost) is no adoption
  a=admitted
  printf '%s' "$run" > "$d/launch/by" || no token-failed
  l=nohup
  command -v setsid >/dev/null && l=setsid
  $l sh "$prod" "$d" "$ws" "$cs" "$hid" "$comp" "$mode" "$@" </dev/null >/dev/null 2>&1 &
  # record the launch before answering, so "alive" is known from the first status;
  # the producer records its own pid once it holds the snapshot
  echo $! > "$d/pid.launch" || {
    kill $!
    no pid-failed
  }
  # answer once the launch has detached (the producer writes its pid in its own
  # session) or ended (another producer holds the snapshot): a backend that kills
  # our process group when it gives up on us, or once we exit, must not catch it
  # (looks 5 ms apart, the pid file read without a fork: the producer takes a few
  # programs to get there, and this wait is on the path of every pull, the smallest
  # included; 2000 looks, or 10 s)
  i=0
  until [ $i -ge 2000 ] || { rd "$d/pid"; [ "$v_" = $! ]; } || ! alive $!; do
    sleep 0.005 || { sleep 1; i=$((i+199)); }
    i=$((i+1))
  done
fi
"""
#: the admission's answer: alone, or with the snapshot's first status after it, long poll
#: included.  The status comes from the producer's ``--status`` mode: its text was hashed
#: above, and the status function's 1.6 KB stay out of this argv (a URL on some backends).
#: Without an answer from it (the producer gone since), the admission's alone: the host
#: then asks for the status itself
_ADMIT_ANSWER = r"""
emit ok "$a $(cat "$d/launch/size")"
"""
_ADMIT_STATUS_ANSWER = r"""
r="$a $(cat "$d/launch/size")"
p=$(sh "$prod" --status "$d" 0 "$sw" "$sil"; echo .)
p=${p%.}
[ -n "$p" ] && r="$r${nl}$p"
emit ok "$r"
"""

_INSTALL = r"""
root=$1 name=$2 i=$3 n=$4 text=$5 run=$6 pe=$7
umask 077
mkdir -p "$root" || { emit err "cannot create the staging root"; exit 0; }
# parts and the join are this run's and this encoding's own: two pulls installing at
# once never mix, nor does a late call of a compressed install with the plain one after it
t=$root/$name.$run.$pe.part
printf '%s' "$text" > "$t$i" || { emit err "cannot write the producer script"; exit 0; }
[ "$i" = $((n - 1)) ] || { emit ok "part $i"; exit 0; }
# part 0 marks a join to do: it goes first, so a retry after the join (killed or not
# while removing the parts) finds none, removes what is left and answers the hash
if [ -f "${t}0" ]; then
  j=0
  : > "$t" || { emit err "cannot write the producer script"; exit 0; }
  while [ $j -lt "$n" ]; do
    cat "$t$j" >> "$t" || { emit err "cannot write the producer script"; exit 0; }
    j=$((j + 1))
  done
  # gz64: the parts spell the script gzipped, in base64 (a third of its length in a URL);
  # what it decodes to is hashed below like any script
  if [ "$pe" = gz64 ]; then
    base64 -d < "$t" | gzip -dc > "$t.z" && mv -f "$t.z" "$t" ||
      { rm -f "$t.z"; emit err "cannot decode the producer script"; exit 0; }
  fi
  mv -f "$t" "$root/$name" || { emit err "cannot write the producer script"; exit 0; }
  rm -f "${t}0"
fi
rm -f "$t"[1-9]*
dg=$(h < "$root/$name")
emit ok "${dg%% *}"
"""

_UPLOAD = r"""
root=$1 id=$2 how=$3 i=$4 n=$5 text=$6 want=$7
[ "$text" = - ] && text=
umask 077
d=$root/$id
no() { emit err "$1"; exit 0; }
[ ! -d "$d/launch" ] || no "already-launched"
mkdir -p "$d" || no "cannot create the staging directory"
if [ "$how" = stdin ]; then
  if [ "$enc" = b64 ]; then base64 -d > "$d/list.tmp"; else cat > "$d/list.tmp"; fi || no "cannot write the list"
else
  printf '%s' "$text" > "$d/list.$i" || no "cannot write the list"
  [ "$i" = $((n - 1)) ] || { emit ok "part $i"; exit 0; }
  j=0
  : > "$d/list.b64" || no "cannot write the list"
  while [ $j -lt "$n" ]; do
    cat "$d/list.$j" >> "$d/list.b64" || no "cannot write the list"
    j=$((j + 1))
  done
  base64 -d < "$d/list.b64" > "$d/list.tmp" || no "cannot write the list"
fi
dg=$(h < "$d/list.tmp")
[ "${dg%% *}" = "$want" ] || no "list-damaged"
mv -f "$d/list.tmp" "$d/list" || no "cannot write the list"
emit ok "${dg%% *}"
"""

_STATUS = r"""
st "$1" "$2" "$3" "$4"
emit ok "$p"
"""

_READ = r"""
f=$1 o=$2 l=$3
sz=$(wc -c < "$f") || { emit err "missing"; exit 0; }
[ $((sz + 0)) -ge $((o + l)) ] || { emit err "short-file $((sz + 0))"; exit 0; }
chunk() { dd if="$f" bs=65536 iflag=skip_bytes,count_bytes skip="$o" count="$l" 2>/dev/null; }
dg=$(chunk | h)
dg=${dg%% *}
[ -n "$dg" ] || { emit err "hash-failed"; exit 0; }
printf 'WSYNC1 BEGIN %s ok %s %s\n' "$nonce" "$l" "$enc"
if [ "$enc" = b64 ]; then chunk | base64; else chunk; fi
printf '\nWSYNC1 END %s %s\n' "$nonce" "$dg"
"""

_CLEANUP = r"""
root=$1 pn=$2 bad=
shift 2
# every id is tried: one that cannot go must not keep the others (a full disk's) there
for id; do
  d=$root/$id
  [ -d "$d" ] || continue
  stop "$d"
  rm -rf "$d" || bad=1
done
[ -z "$bad" ] || { emit err "cannot remove the staging directory"; exit 0; }
emit ok removed
"""


def _compact(script: str) -> str:
    """Drop indentation, blank lines and comment lines.

    Scripts travel in argv, and some backends put argv into a URL (the Sprites
    exec endpoint): servers refuse request lines over about 8 KiB.
    """
    lines = (line.strip() for line in script.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("#")) + "\n"


SCRIPTS: dict[str, str] = {
    "probe": _compact(_PRELUDE + _STAGE + _PROBE),
    "admit": _compact(_PRELUDE + _ADMIT_HEAD + _ADMIT_ARGS + _ADMIT + _ADMIT_ANSWER),
    "admit_status": _compact(
        _PRELUDE + _ADMIT_HEAD + _ADMIT_STATUS_ARGS + _ADMIT + _ADMIT_STATUS_ANSWER
    ),
    "status": _compact(_PRELUDE + STATUS_FN + _STATUS),
    "read": _compact(_PRELUDE + _READ),
    "cleanup": _compact(_PRELUDE + _KILL + _CLEANUP),
    "install": _compact(_PRELUDE + _INSTALL),
    "upload": _compact(_PRELUDE + _UPLOAD),
}
PRODUCER = _compact(_PRODUCER)
#: the producer gzipped (no name, no time: the same bytes every run) in base64
PRODUCER_GZ64 = base64.b64encode(gzip.compress(PRODUCER.encode(), compresslevel=9, mtime=0)).decode(
    "ascii"
)
#: the producer's file name in the staging root (not snapshot-shaped: never GC'd)
PRODUCER_NAME = ".producer-" + hashlib.sha256(PRODUCER.encode()).hexdigest()[:16] + ".sh"


#: the snapshot files the host reads back: the stream, its index, and the lists
#: of files that never settled or that vanished after being read
READABLE = ("data", "index", "unstable", "gone")


class Wire(TypedDict):
    """What every call after the probe passes: how to talk, and where staging is."""

    gate: bool
    nonce: str
    algorithm: str
    b64: bool
    staging_root: str


def check_snapshot_id(snapshot: str) -> str:
    if not SNAPSHOT_ID.fullmatch(snapshot):
        raise UsageError(f"bad snapshot id {snapshot!r} (want [a-z0-9-], 1-64 chars)")
    return snapshot


#: an argument with no value (see :func:`render`)
NONE = "-"


def render(
    name: str, *, gate: bool, nonce: str, algorithm: str, b64: bool, args: tuple[str, ...]
) -> list[str]:
    """argv for one guest call: ``sh -c SCRIPT wsync GATE NONCE HASH ENC ARGS...``.

    No argument may be empty: Daytona's daemons before PR #3918 split the command text
    into words and drop empty ones, which would shift every later argument (a default
    staging root would have become the next argument's text); an argument that may have
    no value passes ``-`` (:data:`NONE`), which no script takes for a value.
    """
    if "" in args:
        raise ValueError(f"an empty argument to the {name} script (pass {NONE!r})")
    return [
        "sh",
        "-c",
        SCRIPTS[name],
        "wsync",
        "1" if gate else "0",
        nonce,
        algorithm,
        "b64" if b64 else "raw",
        *args,
    ]


def check_staging_root(root: str) -> str:
    """The configured staging root, normalized; ``""`` (the default) means
    ``/tmp/wsync-UID``, resolved in the guest by the probe.

    Only absolute (or ``~/``) paths without ``.``/``..`` components: the probe
    locates the root physically before creating anything, by walking up to
    the nearest directory that exists.
    """
    if root == "":
        return root
    if any(ord(c) < 32 or ord(c) == 127 for c in root):
        raise UsageError(f"--staging-dir holds a control character: {root!r}")
    if not (root.startswith("/") or root == "~" or root.startswith("~/")):
        raise UsageError(f"--staging-dir must be an absolute path (or start with ~/): {root!r}")
    if {".", ".."} & set(root.split("/")):
        raise UsageError(f"--staging-dir must not contain '.' or '..' components: {root!r}")
    return re.sub("/+", "/", root).rstrip("/") or "/"


#: the digest a working ``xxhsum -H2`` gives the probe's input: where the guest's gives
#: it, the probe does not try the other hash tools
_PROBE_XXH128 = ALGORITHMS["xxh128"].digest(PROBE_INPUT)


def probe(
    *, gate: bool, nonce: str, b64: bool, workspace: str, staging_root: str, free: bool = False
) -> list[str]:
    """Answers the guest's tools and, once the workspace is a directory, the
    staging root's physical path (created and checked; see :data:`_STAGE`) and, with
    ``free``, its free space (two programs a pull need not run: the admission measures
    the room it checks)."""
    root = check_staging_root(staging_root) or NONE  # (never a configured root: not absolute)
    args = (workspace, root, _PROBE_XXH128, "1" if free else "0")
    return render("probe", gate=gate, nonce=nonce, algorithm="md5", b64=b64, args=args)


#: the longest argv, as one shell command line (:func:`exec_length`), that goes as an exec
#: where argv may be long (``Capabilities.long_argv``): under Dropbear's 9,000-byte
#: command limit (MAX_CMD_LEN), the strictest server of those transports
EXEC_CARRY_MAX = 8 * 1024


def exec_length(argv: Sequence[str]) -> int:
    """The bytes of ``argv`` as one shell command line (how ssh sends an exec)."""
    return len(shlex.join(argv))


#: the longest argv, as a URL's query encodes it (:func:`url_length`), that goes to an exec
#: endpoint taking argv in its URL (Sprites, Kubernetes): servers and proxies refuse request
#: lines over about 8 KiB, and the path and the other parameters come along
URL_ARGV_MAX = 7600


def url_length(argv: Sequence[str]) -> int:
    """The bytes of ``argv`` in a URL's query, one parameter an argument (``urlencode``
    quotes every byte but letters, digits and ``_.-~``), named as the longer of the two
    backends' names (Kubernetes' ``command``; Sprites says ``cmd``)."""
    return sum(len(urllib.parse.quote(arg, safe="")) + len("&command=") for arg in argv)


#: listed sizes from here up (1 EiB) are not passed to the admission: none fits anyway,
#: and ``du`` decides
NEED_KB_MAX = 2**50


def admit(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    workspace: str,
    chunk_size: int,
    compressor: str,
    ttl_minutes: int,
    run: str,
    producer_hash: str,
    mode: str = "tar",
    prune: tuple[str, ...] = (),
    need_kb: int | None = None,
    status_looks: int = -1,
    inline: int = 0,
) -> list[str]:
    """``mode`` is the producer's: ``tar`` (the whole workspace), ``manifest`` (one record
    per entry, ``prune`` naming find ``-name`` globs left out in the guest) or ``select``
    (the entries of the list uploaded with :func:`upload`).

    ``need_kb`` is the workspace's size as this run's listing gave it: a ``tar`` run's
    check for room in the staging admits on it without walking the tree with ``du``
    (which still decides before a refusal).  It goes only to a ``tar`` run and only
    below :data:`NEED_KB_MAX`: a guest's manifest may claim any sizes, and the guest's
    shell arithmetic must never see a number it cannot hold (dash stops at one).

    ``run`` identifies this wsync run: a retried admission it made itself
    answers ``admitted`` again; only another run's snapshot is ``reconciled``.

    The guest runs the installed producer only when it hashes to
    ``producer_hash`` (with the negotiated algorithm); otherwise it answers
    ``producer-missing`` and the host installs it afresh.

    With ``status_looks`` ≥ 0 the answer goes on with the snapshot's status, as
    :func:`status` gives it from index offset 0 with that many looks and ``inline``: the
    first status call, saved.  The status runs from the producer's ``--status`` mode
    (whose hash the admission has just checked), so the script is only a few hundred
    bytes longer than the plain one; the caller sends it as an exec only while it fits
    (:meth:`wsync.engine.guest.GuestSession._exec_fits`: a command line under
    :data:`EXEC_CARRY_MAX`, or a URL under :data:`URL_ARGV_MAX`).
    """
    check_snapshot_id(snapshot)
    if not -1 <= status_looks <= 600 or not 0 <= inline <= STATUS_INLINE_MAX:
        raise ValueError("bad status arguments")
    if chunk_size <= 0 or chunk_size % BLOCK:
        raise UsageError(f"chunk size must be a positive multiple of {BLOCK}")
    args = (
        staging_root,
        snapshot,
        workspace,
        str(chunk_size),
        compressor,
        str(max(1, ttl_minutes)),
        PRODUCER_NAME,
        run,
        producer_hash,
        check_mode(mode),
        str(need_kb)
        if mode == "tar" and need_kb is not None and 0 <= need_kb < NEED_KB_MAX
        else NONE,
        *((str(status_looks), str(inline)) if status_looks >= 0 else ()),
        *prune,
    )
    name = "admit_status" if status_looks >= 0 else "admit"
    return render(name, gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


#: producer text per install call: argv travels in a URL on some backends
INSTALL_PART = 1536
#: the same where an exec's argv may be long (``Capabilities.long_argv``): each call's
#: command line stays under :data:`EXEC_CARRY_MAX` (Dropbear's limit), and
#: the 11 KB producer goes in 3 calls instead of 8 (a round trip each on the HTTP
#: backends, on the first pull of every fresh sandbox)
INSTALL_PART_LONG = 5120
#: parts of :data:`PRODUCER_GZ64` where argv goes in a URL (base64 stays nearly itself
#: there, where the script's text triples): 2 calls instead of 8
INSTALL_PART_GZ64 = 2880


def install_producer(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    part: int,
    run: str,
    part_size: int = INSTALL_PART,
    encoding: str = "raw",
) -> list[str]:
    """Write part ``part`` of the producer script into the staging root.

    ``encoding`` ``gz64`` sends :data:`PRODUCER_GZ64` (for a guest with ``gzip`` and
    ``base64``), which the last call decodes.

    The producer travels on its own, in parts of ``part_size`` characters
    (:data:`INSTALL_PART`, or :data:`INSTALL_PART_LONG` where argv may be long), so that
    no argv grows past what the exec endpoint accepts (URL-based ones refuse request lines
    over about 8 KiB).  Each part is its own file, so a retried call is idempotent; the
    call with the last part joins them (if a retry of it has not already) and answers the
    script's hash.  The name carries
    the hash: a changed producer never runs under an old name.
    """
    count = install_parts(part_size, encoding)
    text = _install_body(encoding)[part * part_size : (part + 1) * part_size]
    args = (staging_root, PRODUCER_NAME, str(part), str(count), text, check_run_id(run), encoding)
    return render("install", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


def check_run_id(run: str) -> str:
    """Run ids become parts of guest file names: hex only."""
    if not re.fullmatch(r"[0-9a-f]{1,32}", run):
        raise ValueError(f"bad run id {run!r}")
    return run


def install_parts(part_size: int = INSTALL_PART, encoding: str = "raw") -> int:
    return -(-len(_install_body(encoding)) // part_size)


def _install_body(encoding: str) -> str:
    """What an install in ``encoding`` sends: the producer (``raw``) or
    :data:`PRODUCER_GZ64` (``gz64``); the guest's install script knows no other."""
    if encoding == "raw":
        return PRODUCER
    if encoding == "gz64":
        return PRODUCER_GZ64
    raise ValueError(f"bad install encoding {encoding!r}")


def snapshot_dir(staging_root: str, snapshot: str) -> str:
    return f"{staging_root.rstrip('/') or '/'}/{check_snapshot_id(snapshot)}"


#: one look of the status script's long poll, seconds
STATUS_LOOK = 0.05
#: the long poll's first looks are shorter: this many, of this many seconds each
FAST_LOOKS, FAST_LOOK = 10, 0.01


def status_looks(wait: float) -> int:
    """The looks of a long poll that waits about ``wait`` seconds at most."""
    if wait <= FAST_LOOKS * FAST_LOOK:
        return round(wait / FAST_LOOK)
    return FAST_LOOKS + round((wait - FAST_LOOKS * FAST_LOOK) / STATUS_LOOK)


def looks_seconds(looks: int) -> float:
    """The longest a long poll of ``looks`` looks sleeps (its deadline allowance)."""
    fast = min(looks, FAST_LOOKS)
    return fast * FAST_LOOK + (looks - fast) * STATUS_LOOK


#: most index bytes one status answer carries
STATUS_INDEX_MAX = 65536


#: the largest finished stream a status answer carries whole (in base64, 4/3 of it):
#: the data of a small workspace's runs, a manifest of some hundreds of entries
STATUS_INLINE_MAX = 48 * 1024


def status(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    index_from: int = -1,
    looks: int = 0,
    inline: int = 0,
) -> list[str]:
    """The snapshot's state.  With ``index_from`` ≥ 0 the answer carries the index from
    that offset (up to :data:`STATUS_INDEX_MAX` bytes); with ``looks`` it first waits, up
    to that many looks (:func:`looks_seconds`), for the index to grow past ``index_from``.
    With ``inline`` (bytes, at most :data:`STATUS_INLINE_MAX`; the guest needs
    ``base64``) a finished stream no longer than that comes along whole."""
    d = snapshot_dir(staging_root, snapshot)
    if index_from < -1 or not 0 <= looks <= 600 or not 0 <= inline <= STATUS_INLINE_MAX:
        raise ValueError("bad status arguments")
    return render(
        "status",
        gate=gate,
        nonce=nonce,
        algorithm=algorithm,
        b64=b64,
        args=(d, str(index_from), str(looks), str(inline)),
    )


def read(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    file: str,
    offset: int,
    length: int,
) -> list[str]:
    if file not in READABLE:
        raise ValueError(file)
    path = f"{snapshot_dir(staging_root, snapshot)}/{file}"
    args = (path, str(offset), str(length))
    return render("read", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


def cleanup(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshots: Sequence[str],
) -> list[str]:
    """Remove the staging of each of ``snapshots`` (a pull's manifest and content runs go
    in one call), stopping a producer still at work in it."""
    if not snapshots:
        raise ValueError("cleanup needs a snapshot")
    for snapshot in snapshots:
        check_snapshot_id(snapshot)
    args = (staging_root, PRODUCER_NAME, *snapshots)
    return render("cleanup", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)


MODES = ("tar", "manifest", "select")
#: list text (base64) per upload call where the list travels in argv
UPLOAD_PART = 4096


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"bad producer mode {mode!r}")
    return mode


def upload(
    *,
    gate: bool,
    nonce: str,
    algorithm: str,
    b64: bool,
    staging_root: str,
    snapshot: str,
    how: str,
    part: int = 0,
    parts: int = 1,
    text: str = "",
    digest: str,
) -> list[str]:
    """Stage the NUL-separated list of a ``select`` run as ``SNAPSHOT/list``.

    ``how="stdin"``: the list follows the gate line on stdin (base64 on text channels).
    ``how="argv"``: part ``part`` of ``parts`` of its base64 ``text`` (no stdin: Cloudflare,
    Daytona); the call with the last part joins and decodes them.  Either way the guest
    moves the list into place only when it hashes to ``digest``.
    """
    if how not in ("stdin", "argv"):
        raise ValueError(how)
    args = (
        staging_root,
        check_snapshot_id(snapshot),
        how,
        str(part),
        str(parts),
        text or NONE,  # ("-" is not base64: an empty part, or no part on stdin)
        digest,
    )
    return render("upload", gate=gate, nonce=nonce, algorithm=algorithm, b64=b64, args=args)
