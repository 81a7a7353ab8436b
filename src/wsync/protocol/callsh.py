"""The shell text of every guest call but the producer's, and the scripts made of it.

Constant POSIX ``sh`` (tested under dash, bash, yash and busybox ``sh``), each run as
``sh -c SCRIPT wsync GATE NONCE HASH ENC ARGS...`` (:func:`wsync.protocol.scripts.render`):
every variable part is a positional argument, never spliced into the text.  The prelude
every script starts with reads those four, waits for the gate line and defines ``emit``,
which prints the one envelope a call answers with.  The layout in the guest and the
rules of the staging root are described in :mod:`wsync.protocol.scripts`; the producer
that writes a snapshot is :mod:`wsync.protocol.producer`.
"""

from __future__ import annotations

from wsync.protocol.producer import KILL_FNS, LSN, PID_CHECKS, STATUS_FN

PRELUDE = (
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

STAGE = r"""
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
  [ -d "$r" ] || mkdir -p "$r" || no "create${nl}$r"
  [ -L "$r" ] && no "symlink${nl}$r"
  R=$(cdp "$r") || no "notdir${nl}$r"
  over "$R"
  lsn "$R"
  [ "$u" = "$me" ] || no "owner $u $me $(ls -ld "$R" | awk '{print $3}')${nl}$R"
  case $m in d*) ;; *) no "notdir${nl}$R" ;; esac
  case $m in ?????w*|????????w*) no "writable $m${nl}$R" ;; esac
  # (R itself just passed a stricter check than chain's)
  chain "${R%/*}"
}
"""

PROBE = r"""
ws=$(expand_home "$1")
p="proto 1${nl}uid $me"
# a line of the answer
a() { p="$p${nl}$1"; }
if [ -d "$ws" ]; then
  if [ -r "$ws" ] && [ -x "$ws" ]; then w=dir; else w=unreadable; fi
elif [ -e "$ws" ]; then w=notdir; else w=missing; fi
a "workspace $w"
for t in tar zstd gzip xxhsum b2sum sha256sum setsid base64 dd wc find ls du id stat readlink xargs; do
  command -v "$t" >/dev/null 2>&1 && a "has_$t 1"
done
# a base64 that encodes what it is given: a status may then carry a small run's stream
# whole and remove its staging with it (the producer's carried)
[ "$(printf wsync-probe | base64)" = d3N5bmMtcHJvYmU= ] && a "has_base64_exact 1"
x=$(printf wsync-probe | xxhsum -H2)
a "test_xxh128 $x"
# the other hash tools only where xxhsum does not answer the digest the host expects
if [ "${x%% *}" != "$3" ]; then
  a "test_b2 $(printf wsync-probe | b2sum)"
  a "test_sha256 $(printf wsync-probe | sha256sum)"
fi
[ "$(printf abcdef | dd bs=65536 iflag=skip_bytes,count_bytes skip=2 count=3 2>/dev/null)" = cde ] &&
  a "has_dd_bytes 1"
# zstd 1.3.2+ matches across 32 MiB (--long=25): a fifth fewer bytes for source trees
printf x | zstd -q -c --long=25 >/dev/null 2>&1 && a "has_zstd_long 1"
v=$(tar --version 2>&1)
a "tar_version ${v%%"$nl"*}"
case $v in *"GNU tar"*) a "has_gnu_tar 1" ;; esac
# find's -printf and -cnewer, for the producer (which then need not ask every run)
for o in printf cnewer; do find / -maxdepth 0 -$o / >/dev/null 2>&1 && a "has_find_$o 1"; done
if [ "$w" = dir ] && command -v ls >/dev/null 2>&1 && command -v id >/dev/null 2>&1; then
  stage "$2" "$ws"
  a "stage_root $R"
  # the free space only where it is shown (wsync doctor): the admission measures its own
  [ "$4" = 1 ] && a "stage_free_kb $(df -Pk "$R" | awk 'NR == 2 { print $4 }')"
fi
emit ok "$p"
"""

KILL = "\nme=$(id -u)\n" + KILL_FNS

#: (``tl``, the producer's tools as the probe saw them: programs fewer per run; ``ttl``
#: ``-``: this pull's stale snapshots are collected)
ADMIT_HEAD = r"""
no() { emit err "$1"; exit 0; }
root=$1 id=$2 ws=$(expand_home "$3") cs=$4 comp=$5 ttl=$6 pn=$7 prod=$1/$7 run=$8 ph=$9 mode=${10}
tl=${11}
"""
ADMIT_ARGS = r"""
n=${12}
shift 12
"""
#: (its status's looks, inline bound and clean flag come before the producer's arguments)
ADMIT_STATUS_ARGS = r"""
n=${12} sw=${13} sil=${14} sc=${15}
shift 15
"""
ADMIT = r"""
# the listed size: digits, or none ("-")
n=${n%%[!0-9]*}
# the probe checked the root and its ancestors; make sure it is still that, and this
# user's (test -O asks without a program: dash, bash, busybox, yash, ksh and zsh have it)
lsn "$root"
[ "$(cd -P "$root" && pwd -P)" = "$root" ] && [ -O "$root" ] || no unsafe-root
# a directory nobody else may write (a mode ls did not give fails too)
case $m in d????[!w]??[!w]*) ;; *) no unsafe-root ;; esac
[ -d "$ws" ] || no workspace-missing
# run only the producer whose hash the host expects (else it is reinstalled)
dg=$(h < "$prod")
[ -f "$prod" ] && [ "${dg%% *}" = "$ph" ] || no producer-missing
umask 077
# stale snapshots go first (the producer's --gc, hashed above: see there), once a pull
[ "$ttl" = - ] || sh "$prod" --gc "$root" "$id" "$ttl" "$pn"
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
# counts as running once it runs the producer on this snapshot (its exec: a moment
# after another admission's fork, in which this one launches again), and the
# producer's claim keeps a second one from running anyway: see the producer
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
a=reconciled go=1 lp=
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
  $l sh "$prod" "$d" "$ws" "$cs" "$hid" "$comp" "$mode" "$tl" "$@" </dev/null >/dev/null 2>&1 &
  # record the launch before answering, so "alive" is known from the first status;
  # the producer records its own pid once it holds the snapshot
  echo $! > "$d/pid.launch" || {
    kill $!
    no pid-failed
  }
  lp=$!
fi
# answer once the launch has detached (the producer writes its pid in its own
# session) or ended (another producer holds the snapshot): a backend that kills
# our process group when it gives up on us, or once we exit, must not catch it
# (looks 5 ms apart, the pid file read without a fork: the producer takes a few
# programs to get there, and this wait is on the path of every pull, the smallest
# included; 2000 looks, or 10 s).  An admission that carries the first status waits
# before it too: until the launch is the producer (its exec, then its pid), the
# launch's pid names a fork of this admission, which the status cannot tell from
# another snapshot's process, so it said nothing runs and did not wait for the first
# chunk.  (The producer writes its pid before its first chunk: a look, 5 ms, at most)
detached() {
  [ -n "$lp" ] || return 0
  i=0
  until [ $i -ge 2000 ] || { rd "$d/pid"; [ "$v_" = "$lp" ]; } || ! alive "$lp"; do
    sleep 0.005 || { sleep 1; i=$((i+199)); }
    i=$((i+1))
  done
}
"""
#: the admission's answer: alone, or with the snapshot's first status after it, long poll
#: included.  The status comes from the producer's ``--status`` mode: its text was hashed
#: above, and the status function's 1.6 KB stay out of this argv (a URL on some backends).
#: Without an answer from it (the producer gone since), the admission's alone: the host
#: then asks for the status itself
ADMIT_ANSWER = r"""
detached
rd "$d/launch/size"
emit ok "$a $v_"
"""
ADMIT_STATUS_ANSWER = r"""
detached
rd "$d/launch/size"
r="$a $v_"
p=$(sh "$prod" --status "$d" 0 "$sw" "$sil" "$sc"; echo .)
p=${p%.}
[ -n "$p" ] && r="$r${nl}$p"
emit ok "$r"
"""

INSTALL = r"""
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

UPLOAD = r"""
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

STATUS = r"""
st "$1" "$2" "$3" "$4"
emit ok "$p"
"""

READ = r"""
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

CLEANUP = r"""
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


def compact(script: str) -> str:
    """Drop indentation, blank lines and comment lines.

    Scripts travel in argv, and some backends put argv into a URL (the Sprites
    exec endpoint): servers refuse request lines over about 8 KiB.
    """
    lines = (line.strip() for line in script.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("#")) + "\n"


SCRIPTS: dict[str, str] = {
    "probe": compact(PRELUDE + STAGE + PROBE),
    "admit": compact(PRELUDE + ADMIT_HEAD + ADMIT_ARGS + ADMIT + ADMIT_ANSWER),
    "admit_status": compact(PRELUDE + ADMIT_HEAD + ADMIT_STATUS_ARGS + ADMIT + ADMIT_STATUS_ANSWER),
    "status": compact(PRELUDE + STATUS_FN + STATUS),
    "read": compact(PRELUDE + READ),
    "cleanup": compact(PRELUDE + KILL + CLEANUP),
    "install": compact(PRELUDE + INSTALL),
    "upload": compact(PRELUDE + UPLOAD),
}
