// The identity tests' OpenID Provider: oidc-provider (OpenID Certified), in
// memory, on loopback, over TLS with the test's own CA. Everything that makes
// it this test's provider comes from one JSON file (argv[2]) that the test
// writes: its issuer and port, its TLS files, its signing keys (private JWKs:
// the first of each type signs, the rest are still published, which is how a
// key rotation is done: restart with [new, old]), its clients, the resource
// servers it issues JWT access tokens for (RFC 8707 resource indicators), and
// where each subject's groups are read. The groups file is read for every
// token, so a group taken away there holds from the next token on.
//
// Each request is printed as one line "<method> <path>" on stdout, so a test
// counts the provider's discovery and JWKS fetches.
import fs from 'node:fs';
import https from 'node:https';
import Provider, { errors } from 'oidc-provider';
import * as jose from 'jose';

const config = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));

function subjectClaims(kind, id) {
  // kind: "clients" (client credentials) or "accounts" (people)
  const all = JSON.parse(fs.readFileSync(config.claims_file, 'utf8'));
  return (all[kind] || {})[id] || {};
}

const provider = new Provider(config.issuer, {
  jwks: config.jwks,
  clients: config.clients,
  pkce: { required: () => true },
  findAccount: async (ctx, sub) => ({
    accountId: sub,
    claims: async () => ({ sub, ...subjectClaims('accounts', sub) }),
  }),
  claims: { openid: ['sub'], profile: ['name', 'preferred_username'], groups: ['groups'] },
  scopes: ['openid', 'offline_access', 'profile', 'groups', ...(config.scopes || [])],
  features: {
    devInteractions: { enabled: true },
    clientCredentials: { enabled: true },
    introspection: { enabled: false },
    revocation: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: async () => config.default_resource,
      useGrantedResource: async () => true,
      getResourceServerInfo: async (ctx, resource) => {
        const info = config.resources[resource];
        if (!info) throw new Error(`unknown resource ${resource}`);
        return {
          scope: info.scope,
          audience: info.audience || resource,
          accessTokenTTL: info.ttl_s || 300,
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: info.alg || 'ES256' } },
        };
      },
    },
  },
  extraTokenClaims: async (ctx, token) => {
    const claims = token.kind === 'ClientCredentials'
      ? subjectClaims('clients', token.clientId)
      : subjectClaims('accounts', token.accountId);
    // RFC 8693 section 4.1: the party acting for the subject.
    return token.gty === TOKEN_EXCHANGE ? { ...claims, act: { sub: token.clientId } } : claims;
  },
  loadExistingGrant: async (ctx) => {
    // Consent is not what these tests are about: every client is first-party.
    const grantId = ctx.oidc.result?.consent?.grantId
      || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid offline_access profile groups');
    grant.addOIDCClaims(['groups', 'preferred_username']);
    for (const [resource, info] of Object.entries(config.resources)) {
      grant.addResourceScope(resource, info.scope);
    }
    await grant.save();
    return grant;
  },
  issueRefreshToken: async (ctx, client, code) => client.grantTypeAllowed('refresh_token'),
  ttl: { AccessToken: 300, ClientCredentials: 300, IdToken: 300, RefreshToken: 3600,
         AuthorizationCode: 60, Interaction: 600, Session: 3600, Grant: 3600 },
});
provider.proxy = false;

// RFC 8693 token exchange, for clients whose metadata allows the grant: a
// subject token this provider issued for the exchanging client's own resource
// becomes a token for the requested resource, for the same person, with the
// client as the actor (act). oidc-provider has no built-in handler for it.
const TOKEN_EXCHANGE = 'urn:ietf:params:oauth:grant-type:token-exchange';
const ACCESS_TOKEN_TYPE = 'urn:ietf:params:oauth:token-type:access_token';
const publicKeys = jose.createLocalJWKSet({
  keys: config.jwks.keys.map(({ d, p, q, dp, dq, qi, ...pub }) => pub),
});
provider.registerGrantType(TOKEN_EXCHANGE, async (ctx) => {
  const { params, client } = ctx.oidc;
  if (params.subject_token_type !== ACCESS_TOKEN_TYPE) {
    throw new errors.InvalidRequest('subject_token_type must be an access token');
  }
  const exchange = (config.token_exchange || {})[client.clientId];
  if (!exchange) throw new errors.UnauthorizedClient('this client may not exchange tokens');
  let payload;
  try {
    ({ payload } = await jose.jwtVerify(params.subject_token, publicKeys, {
      issuer: config.issuer, audience: exchange.subject_audience,
    }));
  } catch (err) {
    throw new errors.InvalidGrant(`subject_token refused (${err.code || 'invalid'})`);
  }
  const resource = params.resource;
  if (!exchange.resources.includes(resource)) {
    throw new errors.InvalidTarget('this client may not ask for that resource');
  }
  const info = config.resources[resource];
  const token = new ctx.oidc.provider.AccessToken({
    accountId: payload.sub, client, gty: TOKEN_EXCHANGE, scope: info.scope,
    grantId: `exchange-${payload.jti || payload.sub}`,
  });
  token.resourceServer = new ctx.oidc.provider.ResourceServer(resource, {
    scope: info.scope, audience: resource, accessTokenTTL: info.ttl_s || 300,
    accessTokenFormat: 'jwt', jwt: { sign: { alg: info.alg || 'ES256' } },
  });
  const value = await token.save();
  ctx.body = {
    access_token: value, issued_token_type: ACCESS_TOKEN_TYPE, token_type: 'Bearer',
    expires_in: token.expiration, scope: token.scope,
  };
}, ['subject_token', 'subject_token_type', 'resource', 'scope', 'audience',
    'requested_token_type', 'actor_token', 'actor_token_type']);
provider.on('server_error', (ctx, err) => console.error('server_error', err));

provider.use(async (ctx, next) => {
  console.log(`${ctx.method} ${ctx.path}`);
  await next();
});

const server = https.createServer(
  { cert: fs.readFileSync(config.tls.cert), key: fs.readFileSync(config.tls.key) },
  provider.callback(),
);
server.listen(config.port, config.host, () => {
  console.log(`listening ${config.issuer}`);
});
for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => server.close(() => process.exit(0)));
}
