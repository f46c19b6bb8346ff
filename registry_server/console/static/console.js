// The approval console's page. It shows what the console sends (already
// escaped there) as text only, and signs approvals here, in the browser,
// with WebCrypto's Ed25519: the private key file is read only when the
// approver signs, decrypted here with its passphrase when it is encrypted,
// imported as a non-extractable key, used once and dropped. Only the signed
// token leaves the page: never the key, never the passphrase. Nothing is kept
// in any browser storage; the CSRF token lives in this script's memory.
'use strict';

(() => {
  const TOKEN_TYPE = 'toolreg-approval+jwt'; // the header typ the server requires
  const JTI_BYTES = 16; // 128 random bits, as the CLI mints them
  const MAX_KEY_FILE_BYTES = 16 * 1024; // a PEM Ed25519 key is ~120 bytes, ~250 encrypted
  // An encrypted key file: PKCS#8 EncryptedPrivateKeyInfo with PBES2, as
  // `toolreg keys generate --encrypt` (cryptography) and `openssl pkcs8 -topk8`
  // write it. Only the one scheme is read; any other is named and refused.
  const OID = {
    PBES2: '1.2.840.113549.1.5.13',
    PBKDF2: '1.2.840.113549.1.5.12',
    HMAC_SHA1: '1.2.840.113549.2.7', // PBKDF2's default PRF (read, then refused)
    HMAC_SHA256: '1.2.840.113549.2.9',
    AES_256_CBC: '2.16.840.1.101.3.4.1.42',
    ED25519: '1.3.101.112',
  };
  const OID_NAMES = { // for the message that refuses them
    '1.2.840.113549.1.5.3': 'PBES1 (MD5, DES)',
    '1.2.840.113549.1.5.10': 'PBES1 (SHA-1, DES)',
    '1.2.840.113549.1.12.1.3': 'PKCS#12 PBE (SHA-1, 3DES)',
    '1.3.6.1.4.1.11591.4.11': 'scrypt',
    [OID.HMAC_SHA1]: 'PBKDF2 with HMAC-SHA1',
    '1.2.840.113549.2.10': 'PBKDF2 with HMAC-SHA384',
    '1.2.840.113549.2.11': 'PBKDF2 with HMAC-SHA512',
    '2.16.840.1.101.3.4.1.2': 'AES-128-CBC',
    '2.16.840.1.101.3.4.1.22': 'AES-192-CBC',
    '1.2.840.113549.3.7': 'DES-EDE3-CBC',
  };
  const MAX_KDF_ITERATIONS = 10000000; // beyond, the page would hang deriving the key
  const AES_BLOCK_BYTES = 16;
  const SUPPORTED_ENCRYPTION = 'PBES2 with PBKDF2-HMAC-SHA256 and AES-256-CBC, as `toolreg keys generate --encrypt` writes it';
  const WRONG_PASSPHRASE = 'Wrong passphrase for this key file.';
  const OPEN_STATES = new Set(['PENDING', 'APPROVED']);
  const KNOWN_STATES = ['PENDING', 'APPROVED', 'CONSUMED', 'REJECTED', 'VOIDED', 'EXPIRED'];
  const EVENT_WORDS = { // WatchApprovalRequests' event types, as a card's last line says them
    CURRENT: 'Open when you signed in',
    OPENED: 'Asked',
    APPROVAL_ADDED: 'Approval added',
    APPROVED: 'Approved: the agent may run it',
    REJECTED: 'Rejected',
    CONSUMED: 'Used: the call ran',
    VOIDED: 'Voided (its tool was deleted or disabled)',
    EXPIRED: 'Expired',
  };

  const $ = (id) => document.getElementById(id);
  const session = { csrf: null, client: '', approver: '', events: null };
  const cards = new Map(); // request id -> card

  // ------------------------------------------------------------ requests

  async function api(method, path, { body, bearer } = {}) {
    const headers = {};
    if (bearer !== undefined) headers.Authorization = `Bearer ${bearer}`;
    if (method !== 'GET' && session.csrf) headers['X-Toolreg-Csrf'] = session.csrf;
    const init = { method, headers, credentials: 'same-origin', cache: 'no-store', redirect: 'error' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      return { ok: false, status: 0, data: { error: 'the console did not answer' } };
    }
    let data = {};
    try {
      data = await response.json();
    } catch (err) {
      data = {};
    }
    if (!data.error && !response.ok) data.error = `refused (HTTP ${response.status})`;
    return { ok: response.ok, status: response.status, data };
  }

  // ------------------------------------------------------------- signing

  function base64url(bytes) {
    let binary = '';
    for (const byte of bytes) binary += String.fromCharCode(byte);
    return btoa(binary).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
  }

  const utf8 = new TextEncoder();

  function fromBase64url(value) {
    const binary = atob(value.replace(/-/g, '+').replace(/_/g, '/'));
    return Uint8Array.from(binary, (c) => c.charCodeAt(0));
  }

  // ------------------------------------------------------------ passkeys

  // Passkeys (WebAuthn) sign in the authenticator, never in this page: the
  // page asks the console for the options or the claims, hands the browser a
  // challenge, and sends back what the authenticator made. The challenge of
  // an approval is SHA-256 of the canonical claims the console sent, computed
  // here with WebCrypto over those very bytes.
  const passkeys = { enabled: false, credentials: [] };

  async function loadPasskeys() {
    const answer = await api('GET', '/api/passkeys');
    passkeys.enabled = answer.ok && answer.data.enabled;
    passkeys.credentials = passkeys.enabled ? answer.data.credentials : [];
    $('passkey-panel').hidden = !passkeys.enabled;
    const count = passkeys.credentials.length;
    text($('passkey-count'), count ? `(${count} in the policy for ${session.approver})`
      : `(none in the policy for ${session.approver} yet)`);
    for (const card of cards.values()) updateButtons(card);
  }

  function passkeyFailure(err) {
    if (err && err.name === 'NotAllowedError') return 'The passkey prompt was cancelled or timed out.';
    if (err && err.name === 'InvalidStateError') return 'This authenticator already holds a passkey of yours.';
    return `The passkey did not answer: ${err && err.message ? err.message : err}`;
  }

  async function enrolPasskey() {
    const status = $('passkey-status');
    text(status, 'Creating a passkey\u2026');
    const options = await api('POST', '/api/passkeys/enrol/options');
    if (!options.ok) {
      text(status, options.data.error);
      return;
    }
    const o = options.data;
    let credential;
    try {
      credential = await navigator.credentials.create({
        publicKey: {
          challenge: fromBase64url(o.challenge),
          rp: o.rp,
          user: { id: fromBase64url(o.user.id), name: o.user.name, displayName: o.user.displayName },
          pubKeyCredParams: o.algorithms.map((alg) => ({ type: 'public-key', alg })),
          excludeCredentials: o.exclude.map((id) => ({ type: 'public-key', id: fromBase64url(id) })),
          authenticatorSelection: { residentKey: 'preferred', requireResidentKey: false, userVerification: 'required' },
          attestation: 'none',
          timeout: o.timeout_ms,
        },
      });
    } catch (err) {
      text(status, passkeyFailure(err));
      return;
    }
    const answer = await api('POST', '/api/passkeys/enrol', {
      body: {
        credential_id: base64url(new Uint8Array(credential.rawId)),
        client_data_json: base64url(new Uint8Array(credential.response.clientDataJSON)),
        attestation_object: base64url(new Uint8Array(credential.response.attestationObject)),
      },
    });
    if (!answer.ok) {
      text(status, answer.data.error);
      return;
    }
    const lines = $('passkey-lines');
    text(lines, answer.data.policy_lines);
    lines.hidden = false;
    text(status, 'Passkey created. Send these lines to an operator: it approves once they are in the policy.');
  }

  function approveWithPasskey(card) {
    const detail = card.detail;
    if (!detail || !detail.signable) return;
    withBusy(card, async () => {
      setOutcome(card, 'Asking your passkey\u2026', '');
      const path = `/api/requests/${encodeURIComponent(card.id)}`;
      const given = await api('GET', `${path}/passkey-claims`);
      if (!given.ok) {
        setOutcome(card, given.data.error, 'bad');
        return;
      }
      const claims = given.data.claims;
      let assertion;
      try {
        const challenge = new Uint8Array(await crypto.subtle.digest('SHA-256', utf8.encode(claims)));
        assertion = await navigator.credentials.get({
          publicKey: {
            challenge,
            rpId: given.data.rp_id,
            allowCredentials: given.data.credentials.map((id) => ({ type: 'public-key', id: fromBase64url(id) })),
            userVerification: 'required',
            timeout: given.data.timeout_ms,
          },
        });
      } catch (err) {
        setOutcome(card, passkeyFailure(err), 'bad');
        return;
      }
      const response = assertion.response;
      const answer = await api('POST', `${path}/approve-passkey`, {
        body: {
          claims,
          credential_id: base64url(new Uint8Array(assertion.rawId)),
          authenticator_data: base64url(new Uint8Array(response.authenticatorData)),
          client_data_json: base64url(new Uint8Array(response.clientDataJSON)),
          signature: base64url(new Uint8Array(response.signature)),
        },
      });
      if (!answer.ok) {
        setOutcome(card, answer.data.error, 'bad');
        return;
      }
      const after = answer.data.request;
      setOutcome(card, `Approved with a passkey as ${session.approver}: ${after.approved_by.length} of `
        + `${after.approvals_required} approvals, state ${after.state}.`, 'ok');
    });
  }

  $('passkey-enrol').addEventListener('click', () => enrolPasskey());
  const segment = (value) => base64url(utf8.encode(JSON.stringify(value)));

  // ----------------------------------------------------------- key files

  // A minimal DER reader, for the few structures of a PKCS#8 key file: the
  // element at `at` (its tag and contents), definite lengths only, every
  // length checked against the bytes its parent holds.
  class KeyFileError extends Error {}
  const TAG = { INTEGER: 0x02, OCTET_STRING: 0x04, NULL: 0x05, OID: 0x06, SEQUENCE: 0x30 };

  function derElement(bytes, at, end) {
    if (at + 2 > end) throw new KeyFileError();
    const tag = bytes[at];
    let length = bytes[at + 1];
    let start = at + 2;
    if (length & 0x80) {
      const count = length & 0x7f;
      if (count === 0 || count > 3 || start + count > end) throw new KeyFileError();
      length = 0;
      for (let i = 0; i < count; i += 1) length = length * 256 + bytes[start + i];
      start += count;
    }
    if (start + length > end) throw new KeyFileError();
    return { tag, start, end: start + length, contents: bytes.subarray(start, start + length) };
  }

  // The elements inside a SEQUENCE, which must fill it exactly.
  function derSequence(element, bytes) {
    if (!element || element.tag !== TAG.SEQUENCE) throw new KeyFileError();
    const items = [];
    for (let at = element.start; at < element.end; at = items[items.length - 1].end) {
      items.push(derElement(bytes, at, element.end));
    }
    return items;
  }

  // The one element a whole DER blob holds (nothing may follow it).
  function derTop(bytes) {
    const top = derElement(bytes, 0, bytes.length);
    if (top.end !== bytes.length) throw new KeyFileError();
    return top;
  }

  function derOid(element) {
    if (!element || element.tag !== TAG.OID || element.contents.length === 0) throw new KeyFileError();
    const arcs = [];
    let value = 0;
    for (const byte of element.contents) {
      value = value * 128 + (byte & 0x7f);
      if (value > Number.MAX_SAFE_INTEGER / 128) throw new KeyFileError();
      if (!(byte & 0x80)) {
        arcs.push(value);
        value = 0;
      }
    }
    if (element.contents[element.contents.length - 1] & 0x80) throw new KeyFileError();
    const first = arcs[0] < 80 ? Math.floor(arcs[0] / 40) : 2;
    return [first, arcs[0] - first * 40, ...arcs.slice(1)].join('.');
  }

  function derOctets(element) {
    if (!element || element.tag !== TAG.OCTET_STRING) throw new KeyFileError();
    return element.contents;
  }

  function derSmallInteger(element) {
    if (!element || element.tag !== TAG.INTEGER || element.contents.length === 0
      || element.contents.length > 4 || element.contents[0] & 0x80) throw new KeyFileError();
    return element.contents.reduce((value, byte) => value * 256 + byte, 0);
  }

  function unsupported(oid) {
    const name = Object.hasOwn(OID_NAMES, oid) ? OID_NAMES[oid] : `algorithm ${oid}`;
    return new Error(`This key file is encrypted with ${name}, which this page cannot decrypt: it reads ${SUPPORTED_ENCRYPTION}.`);
  }

  // EncryptedPrivateKeyInfo (RFC 5958) with PBES2 params (RFC 8018): what it takes to decrypt it.
  function encryptedKeyInfo(der) {
    const [algorithm, data, ...extra] = derSequence(derTop(der), der);
    const [scheme, params] = derSequence(algorithm, der);
    if (derOid(scheme) !== OID.PBES2) throw unsupported(derOid(scheme));
    const [kdf, cipher] = derSequence(params, der);
    const [kdfOid, kdfParams] = derSequence(kdf, der);
    if (derOid(kdfOid) !== OID.PBKDF2) throw unsupported(derOid(kdfOid));
    const [salt, count, ...rest] = derSequence(kdfParams, der);
    const keyLength = rest.length && rest[0].tag === TAG.INTEGER ? derSmallInteger(rest.shift()) : null;
    const prf = rest.length ? derOid(derSequence(rest.shift(), der)[0]) : OID.HMAC_SHA1;
    if (rest.length || extra.length) throw new KeyFileError();
    if (prf !== OID.HMAC_SHA256) throw unsupported(prf);
    const [cipherOid, iv] = derSequence(cipher, der);
    if (derOid(cipherOid) !== OID.AES_256_CBC) throw unsupported(derOid(cipherOid));
    const info = {
      salt: derOctets(salt),
      iterations: derSmallInteger(count),
      iv: derOctets(iv),
      data: derOctets(data),
    };
    if (keyLength !== null && keyLength !== 32) throw new KeyFileError();
    if (info.iv.length !== AES_BLOCK_BYTES || info.data.length % AES_BLOCK_BYTES !== 0) throw new KeyFileError();
    if (info.iterations < 1 || info.iterations > MAX_KDF_ITERATIONS) {
      throw new Error(`This key file asks for ${info.iterations} key derivation rounds; this page does at most ${MAX_KDF_ITERATIONS}.`);
    }
    return info;
  }

  // The algorithm of a PrivateKeyInfo (RFC 5958), or null when it is not one.
  function privateKeyAlgorithm(pkcs8) {
    try {
      const [version, algorithm] = derSequence(derTop(pkcs8), pkcs8);
      derSmallInteger(version);
      return derOid(derSequence(algorithm, pkcs8)[0]);
    } catch (err) {
      return null;
    }
  }

  // The PKCS#8 DER inside an encrypted key file. WebCrypto does the PBKDF2 and
  // the AES; a wrong passphrase shows as bad padding or as garbage that is no
  // PrivateKeyInfo.
  async function decryptKey(der, passphrase) {
    const info = encryptedKeyInfo(der);
    const secret = utf8.encode(passphrase);
    let plain;
    try {
      const base = await crypto.subtle.importKey('raw', secret, 'PBKDF2', false, ['deriveKey']);
      const aes = await crypto.subtle.deriveKey(
        { name: 'PBKDF2', salt: info.salt, iterations: info.iterations, hash: 'SHA-256' },
        base, { name: 'AES-CBC', length: 256 }, false, ['decrypt'],
      );
      try {
        plain = new Uint8Array(await crypto.subtle.decrypt({ name: 'AES-CBC', iv: info.iv }, aes, info.data));
      } catch (err) {
        throw new Error(WRONG_PASSPHRASE);
      }
    } finally {
      secret.fill(0);
    }
    if (privateKeyAlgorithm(plain) === null) {
      plain.fill(0);
      throw new Error(WRONG_PASSPHRASE);
    }
    return plain;
  }

  // The PEM `toolreg keys generate` writes: PKCS#8, encrypted with a passphrase
  // (--encrypt) or not. Errors never quote the file or the passphrase.
  async function importKey(file, passphrase) {
    if (file.size > MAX_KEY_FILE_BYTES) throw new Error('That file is too large to be an Ed25519 private key.');
    const text = await file.text();
    const found = /-----BEGIN (ENCRYPTED )?PRIVATE KEY-----([A-Za-z0-9+/=\s]+)-----END \1PRIVATE KEY-----/.exec(text);
    if (!found) throw new Error('Not a private key file (expected a PKCS#8 PEM as written by `toolreg keys generate`).');
    let der;
    try {
      der = Uint8Array.from(atob(found[2].replace(/\s+/g, '')), (c) => c.charCodeAt(0));
    } catch (err) {
      throw new Error('Not a readable PEM file.');
    }
    let pkcs8 = der;
    try {
      if (found[1]) {
        if (!passphrase) throw new Error('This key file is encrypted: type its passphrase (above), then approve again.');
        try {
          pkcs8 = await decryptKey(der, passphrase);
        } catch (err) {
          if (err instanceof KeyFileError) throw new Error('Not a readable encrypted key file.');
          throw err;
        }
        if (privateKeyAlgorithm(pkcs8) !== OID.ED25519) throw new Error('Not an Ed25519 private key (the file holds another kind of key).');
      }
      try {
        return await crypto.subtle.importKey('pkcs8', pkcs8, { name: 'Ed25519' }, false, ['sign']);
      } catch (err) {
        throw new Error('Not an Ed25519 private key (expected a PKCS#8 PEM).');
      }
    } finally {
      der.fill(0);
      pkcs8.fill(0);
    }
  }

  // -------------------------------------------------------------- tokens

  // The token `toolreg approvals approve` mints (signing/tokens.py mint_for, bound to the
  // request): the claims the console checked, with iat/exp by the console's clock.
  async function mint(key, claims, skewSeconds) {
    const now = Math.floor(Date.now() / 1000 + skewSeconds);
    const payload = {
      iss: claims.iss,
      aud: claims.aud,
      sub: claims.sub,
      tool_digest: claims.tool_digest,
      args_digest: claims.args_digest,
      requester: claims.requester,
      iat: now,
      exp: now + claims.ttl_s,
      jti: base64url(crypto.getRandomValues(new Uint8Array(JTI_BYTES))),
      req: claims.req,
    };
    const input = `${segment({ alg: 'EdDSA', typ: TOKEN_TYPE })}.${segment(payload)}`;
    const signature = await crypto.subtle.sign({ name: 'Ed25519' }, key, utf8.encode(input));
    return `${input}.${base64url(new Uint8Array(signature))}`;
  }

  // --------------------------------------------------------------- cards

  function text(element, value) {
    element.textContent = value == null ? '' : String(value);
  }

  // One approval rule that applies to the request, and why: "2 approval(s)
  // from sre: rule sre-prod, when <code>args.env == "prod"</code>". Text
  // nodes and elements only (the values are the console's escaped text).
  function ruleItem(rule) {
    const item = document.createElement('li');
    item.className = 'rule';
    const who = rule.groups.length ? rule.groups.join(', ') : 'any approver';
    const needs = document.createElement('span');
    needs.className = 'rule-needs';
    text(needs, `${rule.approvals_required} approval(s) from ${who}`);
    item.append(needs, ': ');
    if (rule.default) {
      item.append('no rule of the policy matches: the default for dangerous tools');
      return item;
    }
    const name = document.createElement('strong');
    name.className = 'rule-name';
    text(name, rule.name);
    item.append(/^rule /.test(rule.name) ? '' : 'rule ', name);
    if (rule.condition) {
      const condition = document.createElement('code');
      condition.className = 'rule-condition';
      text(condition, rule.condition);
      item.append(', when ', condition);
    } else {
      item.append(` (${rule.match})`);
    }
    return item;
  }

  function newCard(id) {
    const root = $('card-template').content.firstElementChild.cloneNode(true);
    const card = {
      id,
      root,
      title: root.querySelector('.card-title'),
      badge: root.querySelector('.badge'),
      event: root.querySelector('.card-event'),
      fields: root.querySelector('.fields tbody'),
      rules: root.querySelector('.rules'),
      ruleList: root.querySelector('.rule-list'),
      check: root.querySelector('.check'),
      argumentsHeading: root.querySelector('.arguments-heading'),
      argumentsText: root.querySelector('.arguments'),
      approve: root.querySelector('.approve'),
      approvePasskey: root.querySelector('.approve-passkey'),
      reason: root.querySelector('.reason'),
      reject: root.querySelector('.reject'),
      notSignable: root.querySelector('.not-signable'),
      outcome: root.querySelector('.outcome'),
      state: '',
      detail: null,
      skew: 0,
      seq: 0,
      busy: false,
      stale: true,
      confirmed: true,
    };
    root.dataset.requestId = id;
    card.approve.addEventListener('click', () => approve(card));
    card.approvePasskey.addEventListener('click', () => approveWithPasskey(card));
    card.reject.addEventListener('click', () => reject(card));
    cards.set(id, card);
    $('requests').prepend(root);
    showEmpty();
    showLinked();
    return card;
  }

  // A webhook links to #/requests/<id>: that request is marked and scrolled to
  // once it is on the page (only an id of the registry's own shape is read).
  function linkedId() {
    const match = /^#\/requests\/([0-9a-f]{32})$/.exec(window.location.hash);
    return match ? match[1] : '';
  }

  function showLinked() {
    const id = linkedId();
    for (const card of cards.values()) card.root.classList.toggle('linked', card.id === id);
    const card = cards.get(id);
    if (card) card.root.scrollIntoView({ block: 'start' });
  }

  window.addEventListener('hashchange', showLinked);

  function showEmpty() {
    $('empty').hidden = cards.size > 0;
  }

  function setState(card, stateName) {
    card.state = stateName;
    text(card.badge, stateName);
    card.badge.classList.remove(...KNOWN_STATES);
    if (KNOWN_STATES.includes(stateName)) card.badge.classList.add(stateName);
    card.root.classList.toggle('done', !OPEN_STATES.has(stateName));
    updateButtons(card);
  }

  function updateButtons(card) {
    const open = OPEN_STATES.has(card.state);
    card.approve.disabled = card.busy || card.stale || !open || !card.detail || !card.detail.signable;
    card.approvePasskey.hidden = passkeys.credentials.length === 0;
    card.approvePasskey.disabled = card.approve.disabled;
    card.reject.disabled = card.busy || !open;
    card.reason.disabled = !open;
    text(card.notSignable, open && card.detail && !card.detail.signable ? card.detail.not_signable : '');
  }

  function setOutcome(card, message, kind) {
    text(card.outcome, message);
    card.outcome.classList.toggle('ok', kind === 'ok');
    card.outcome.classList.toggle('bad', kind === 'bad');
  }

  function onRequestEvent(message) {
    const summary = message.request;
    const card = cards.get(summary.id) || newCard(summary.id);
    card.confirmed = true;
    text(card.title, `${summary.tool_name} asked by ${summary.requested_by}`);
    const at = message.at ? ` at ${new Date(message.at).toLocaleTimeString()}` : '';
    const actor = message.actor ? ` by ${message.actor}` : '';
    const reason = message.reason ? `: ${message.reason}` : '';
    const what = Object.hasOwn(EVENT_WORDS, message.event) ? EVENT_WORDS[message.event] : message.event;
    text(card.event, `${what}${actor}${at}${reason}`);
    setState(card, summary.state);
    refreshDetail(card);
  }

  // Signing waits for the detail as it is now: what is shown may be a change behind.
  async function refreshDetail(card) {
    const seq = ++card.seq;
    card.stale = true;
    updateButtons(card);
    const answer = await api('GET', `/api/requests/${encodeURIComponent(card.id)}`);
    if (seq !== card.seq) return; // a newer look is on its way
    if (!answer.ok) {
      card.detail = null;
      setOutcome(card, answer.data.error, 'bad');
      updateButtons(card);
      return;
    }
    const detail = answer.data;
    card.detail = detail;
    card.stale = false;
    card.skew = detail.server_time - Date.now() / 1000;
    const rows = detail.fields.map(([label, value]) => {
      const row = document.createElement('tr');
      const head = document.createElement('th');
      const cell = document.createElement('td');
      text(head, label);
      text(cell, value);
      row.append(head, cell);
      return row;
    });
    card.fields.replaceChildren(...rows);
    const rules = (detail.applied_rules || []).map(ruleItem);
    card.ruleList.replaceChildren(...rules);
    card.rules.hidden = rules.length === 0;
    const problems = [];
    if (!detail.checks.definition) problems.push('the definition shown DOES NOT match tool_digest');
    if (!detail.checks.arguments) problems.push('the arguments shown DO NOT match arguments_digest');
    text(card.check, problems.length
      ? `\u2717 ${problems.join('; ')}: signing is disabled`
      : '\u2713 The definition and the arguments shown match the digests you sign');
    card.check.classList.toggle('ok', problems.length === 0);
    card.check.classList.toggle('bad', problems.length > 0);
    text(card.argumentsHeading, detail.arguments_heading);
    text(card.argumentsText, detail.arguments);
    setState(card, detail.state);
  }

  async function withBusy(card, work) {
    card.busy = true;
    updateButtons(card);
    try {
      await work();
    } finally {
      card.busy = false;
      updateButtons(card);
      refreshDetail(card);
    }
  }

  function approve(card) {
    const detail = card.detail;
    if (!detail || !detail.signable) return;
    const file = $('key-file').files[0];
    if (!file) {
      setOutcome(card, 'Choose your private key file first (above).', 'bad');
      return;
    }
    withBusy(card, async () => {
      setOutcome(card, 'Signing in this browser\u2026', '');
      let token;
      try {
        const key = await importKey(file, $('key-passphrase').value);
        token = await mint(key, detail.claims, card.skew);
      } catch (err) {
        setOutcome(card, err.message, 'bad');
        return;
      }
      const answer = await api('POST', `/api/requests/${encodeURIComponent(card.id)}/approve`, { body: { token } });
      if (!answer.ok) {
        setOutcome(card, answer.data.error, 'bad');
        return;
      }
      const after = answer.data.request;
      setOutcome(card, `Approved as ${session.approver}: ${after.approved_by.length} of `
        + `${after.approvals_required} approvals, state ${after.state}.`, 'ok');
    });
  }

  function reject(card) {
    const reason = card.reason.value.trim();
    if (!reason) {
      setOutcome(card, 'Say why you reject it (the agent is told).', 'bad');
      return;
    }
    withBusy(card, async () => {
      const answer = await api('POST', `/api/requests/${encodeURIComponent(card.id)}/reject`, { body: { reason } });
      if (!answer.ok) {
        setOutcome(card, answer.data.error, 'bad');
        return;
      }
      setOutcome(card, `Rejected as ${answer.data.request.rejected_by}.`, 'ok');
    });
  }

  // ---------------------------------------------------------- live feed

  function setStatus(message, kind) {
    const status = $('status');
    text(status, message);
    status.classList.toggle('live', kind === 'live');
    status.classList.toggle('trouble', kind === 'trouble');
  }

  function openRequests() {
    let count = 0;
    for (const card of cards.values()) if (OPEN_STATES.has(card.state)) count += 1;
    return count;
  }

  function onMessage(event) {
    const message = JSON.parse(event.data);
    switch (message.kind) {
      case 'start': // a fresh stream: what it does not confirm by `synced` is gone
      case 'reset':
        for (const card of cards.values()) card.confirmed = false;
        if (message.kind === 'reset') setStatus(`The registry watch ended (${message.error}); reconnecting\u2026`, 'trouble');
        break;
      case 'synced':
        for (const [id, card] of cards) {
          if (!card.confirmed) {
            card.root.remove();
            cards.delete(id);
          }
        }
        showEmpty();
        setStatus(`Live: ${openRequests()} open request(s)`, 'live');
        break;
      case 'request':
        onRequestEvent(message);
        setStatus(`Live: ${openRequests()} open request(s)`, 'live');
        break;
      case 'signed-out':
        signedOut(message.reason);
        break;
      default: // 'resync': the stream ends and the browser opens a fresh one
        break;
    }
  }

  function watch() {
    const events = new EventSource('/api/events');
    session.events = events;
    events.onmessage = onMessage;
    events.onerror = async () => {
      if (events.readyState !== EventSource.CLOSED) {
        setStatus('Connection lost; reconnecting\u2026', 'trouble');
        return;
      }
      const answer = await api('GET', '/api/session');
      if (answer.ok) {
        setStatus('Connection lost; reload the page to reconnect.', 'trouble');
      } else {
        signedOut('Your session ended; sign in again.');
      }
    };
  }

  // ------------------------------------------------------------ sessions

  function signedIn(who) {
    session.csrf = who.csrf;
    session.client = who.client;
    session.approver = who.approver;
    $('sso').hidden = !who.sso; // for when this session ends
    text($('who-client'), who.client);
    text($('who-approver'), who.approver);
    $('who').hidden = false;
    $('sign-in').hidden = true;
    $('console').hidden = false;
    text($('sign-in-error'), '');
    setStatus('Connecting\u2026', '');
    watch();
    loadPasskeys();
  }

  function signedOut(reason) {
    if (session.events) session.events.close();
    session.events = null;
    session.csrf = null;
    for (const card of cards.values()) card.root.remove();
    cards.clear();
    showEmpty();
    $('who').hidden = true;
    $('console').hidden = true;
    $('sign-in').hidden = false;
    $('key-file').value = '';
    $('key-passphrase').value = '';
    text($('passkey-lines'), '');
    $('passkey-lines').hidden = true;
    text($('passkey-status'), '');
    text($('sign-in-error'), reason || '');
    setStatus('Not signed in', '');
  }

  $('sign-in-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const input = $('token');
    const bearer = input.value.trim();
    input.value = '';
    const answer = await api('POST', '/api/session', { bearer });
    if (!answer.ok) {
      text($('sign-in-error'), answer.data.error);
      return;
    }
    signedIn(answer.data);
  });

  $('sign-out').addEventListener('click', async () => {
    await api('POST', '/api/session/end');
    signedOut('Signed out.');
  });

  // Why an SSO sign-in did not go through: the console sends the browser
  // back with one of these keys (#sso-error=KEY), never with its details.
  const SSO_ERRORS = {
    state: 'That sign-in was not started in this browser, was already used or took too long. Sign in again.',
    idp: 'The identity provider did not sign you in.',
    exchange: 'The identity provider refused to complete the sign-in. Sign in again.',
    token: 'The identity provider\'s answer could not be verified, so you are not signed in.',
    'not-approver': 'Your account is not an approver here: none of your groups gives the approve role with an approver key in the policy.',
    throttled: 'Too many failed sign-ins; wait a few minutes and try again.',
    unavailable: 'The identity provider could not be reached; try again later.',
    full: 'Too many people are signed in right now; try again when a session ends.',
  };

  function ssoError() {
    const match = /^#sso-error=([a-z-]{1,32})$/.exec(window.location.hash);
    if (!match) return '';
    window.history.replaceState(null, '', window.location.pathname);
    return Object.hasOwn(SSO_ERRORS, match[1]) ? SSO_ERRORS[match[1]] : 'The SSO sign-in did not go through.';
  }

  // A reload keeps the session (its cookie) but not the CSRF token: ask for it.
  const refused = ssoError();
  api('GET', '/api/session').then((answer) => {
    if (answer.ok) {
      signedIn(answer.data);
      return;
    }
    $('sso').hidden = !answer.data.sso;
    text($('sign-in-error'), refused);
  });
})();
