package kernels

import (
	_ "embed"
	"slices"
	"strings"
)

// archive is a package archive kernels come from.
type archive struct {
	url string
	// securityURL serves the suites named *-security, where Debian puts its
	// kernel updates; "" means url serves them too.
	securityURL string
	// keyring is the file apt checks the archive's signature with. Debian's is
	// on every Debian machine (debian-archive-keyring, which also holds the
	// bullseye keys); Ubuntu's is not packaged for Debian 12, so its public key
	// is kept here.
	keyring string
	key     []byte
}

// ubuntuArchiveKey is "Ubuntu Archive Automatic Signing Key (2018)
// <ftpmaster@ubuntu.com>", fingerprint F6EC B376 2474 EDA9 D21B 7022 8719 20D1
// 991B C93C, exported from Ubuntu's ubuntu-keyring package (2021.03.26). It
// signs jammy's Release files.
//
//go:embed keys/ubuntu-archive-2018.asc
var ubuntuArchiveKey []byte

var archives = map[string]archive{
	"debian": {
		url:         "http://deb.debian.org/debian",
		securityURL: "http://deb.debian.org/debian-security",
		keyring:     "/usr/share/keyrings/debian-archive-keyring.gpg",
	},
	"ubuntu": {
		url: "http://archive.ubuntu.com/ubuntu",
		key: ubuntuArchiveKey,
	},
}

func archiveNames() []string {
	var names []string
	for n := range archives {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// suiteURL is where suite lives.
func (a archive) suiteURL(suite string) string {
	if a.securityURL != "" && strings.HasSuffix(suite, "-security") {
		return a.securityURL
	}
	return a.url
}
