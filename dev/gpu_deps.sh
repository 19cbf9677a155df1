# Sourced on the GPU machine (which has no package registry) before building: unpacks the Debian packages of
# the libraries it lacks (PCRE2, and ICU when absent) from .gpu-debs/ — downloaded on the development machine
# with `apt-get download libpcre2-dev libpcre2-8-0 libicu-dev libicu72` and carried — into /opt/lathe-deps, and
# points pkg-config and the loader there. Nothing is unpacked into /.
D=/opt/lathe-deps
mkdir -p $D
for pkg in libpcre2-8 icu-uc; do
  pkg-config --exists $pkg && continue
  case $pkg in libpcre2-8) pat="libpcre2-*";; icu-uc) pat="libicu*";; esac
  for f in .gpu-debs/$pat.deb; do dpkg -x "$f" $D; done
done
for pc in $D/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do [ -f "$pc" ] && sed -i -E "s|^prefix *= */usr *\$|prefix=$D/usr|" "$pc"; done
export PKG_CONFIG_PATH=$D/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
